// The node's namespace table (node/src/namespace_registry.h): ids given by the node in order,
// one per exact name, kept across restarts in a file, a torn last line dropped, a damaged file
// refused, the table's size bounded.

#include "namespace_registry.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "temp_dir.h"

namespace kvstash::node {
namespace {

using ::testing::HasSubstr;

std::string Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(NamespaceRegistryTest, EachExactNameGetsItsOwnIdInOrder) {
  auto registry = NamespaceRegistry::Open("", 16);
  ASSERT_TRUE(registry.ok()) << registry.status().ToString();
  NamespaceRegistry& r = **registry;
  EXPECT_EQ(*r.Register("tenant-a"), 1u);
  EXPECT_EQ(*r.Register("tenant-b"), 2u);
  EXPECT_EQ(*r.Register("tenant-a"), 1u);
  // Names that differ in any byte, case or trailing space included, are different namespaces.
  EXPECT_EQ(*r.Register("Tenant-a"), 3u);
  EXPECT_EQ(*r.Register("tenant-a "), 4u);
  EXPECT_EQ(*r.Register(std::string("tenant-a\0x", 10)), 5u);
  EXPECT_EQ(r.Find("tenant-b"), 2u);
  EXPECT_EQ(r.Find("nobody"), std::nullopt);
  EXPECT_TRUE(r.Known(5));
  EXPECT_FALSE(r.Known(6));
  EXPECT_EQ(r.NameOf(2), "tenant-b");
}

TEST(NamespaceRegistryTest, BadNamesAndAFullTableAreRefused) {
  auto registry = NamespaceRegistry::Open("", 2);
  ASSERT_TRUE(registry.ok());
  NamespaceRegistry& r = **registry;
  EXPECT_EQ(r.Register("").status().code(), StatusCode::kInvalidArgument);
  const Status long_name = r.Register(std::string(257, 'x')).status();
  EXPECT_EQ(long_name.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(long_name.message()), HasSubstr("257 bytes"));
  ASSERT_TRUE(r.Register(std::string(256, 'x')).ok());
  ASSERT_TRUE(r.Register("b").ok());
  const Status full = r.Register("c").status();
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(full.message()), HasSubstr("2 namespaces"));
  EXPECT_TRUE(r.Register("b").ok());  // known names still have their id
}

TEST(NamespaceRegistryTest, IdsSurviveARestartAndNewNamesFollowThem) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/namespaces";
  {
    auto r = NamespaceRegistry::Open(path, 16);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(*(*r)->Register("a"), 1u);
    EXPECT_EQ(*(*r)->Register("b\nwith a newline"), 2u);
  }
  auto r = NamespaceRegistry::Open(path, 16);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->Find("a"), 1u);
  EXPECT_EQ((*r)->Find("b\nwith a newline"), 2u);
  EXPECT_EQ(*(*r)->Register("c"), 3u);
}

TEST(NamespaceRegistryTest, ATornLastLineIsDroppedAndOverwritten) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/namespaces";
  {
    auto r = NamespaceRegistry::Open(path, 16);
    ASSERT_TRUE(r.ok());
    ASSERT_TRUE((*r)->Register("a").ok());
  }
  {
    std::ofstream out(path, std::ios::app | std::ios::binary);
    out << "2 6";  // a crash in the middle of appending "2 62\n"
  }
  {
    auto r = NamespaceRegistry::Open(path, 16);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_FALSE((*r)->Known(2));
    EXPECT_EQ(*(*r)->Register("c"), 2u);
  }
  EXPECT_EQ(Read(path), "1 61\n2 63\n");
}

TEST(NamespaceRegistryTest, ADamagedTableIsRefusedNamingItsLine) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/namespaces";
  for (const std::string text :
       {"1 61\nnonsense\n", "1 61\n1 62\n", "1 61\n2 61\n", "0 61\n", "1 6\n", "1 zz\n", "1 \n"}) {
    SCOPED_TRACE(text);
    std::ofstream(path, std::ios::trunc | std::ios::binary) << text;
    auto r = NamespaceRegistry::Open(path, 16);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("is damaged"));
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(path));
  }
}

}  // namespace
}  // namespace kvstash::node
