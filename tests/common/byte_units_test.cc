#include "kvstash/common/byte_units.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvstash {
namespace {

using ::testing::HasSubstr;

TEST(ByteUnitsTest, ParsesPlainCountsAndPowerOfTwoSuffixes) {
  EXPECT_EQ(*ParseBytes("--x", "262144"), 262144u);
  EXPECT_EQ(*ParseBytes("--x", "256K"), 256u << 10);
  EXPECT_EQ(*ParseBytes("--x", "256k"), 256u << 10);
  EXPECT_EQ(*ParseBytes("--x", "2MiB"), 2u << 20);
  EXPECT_EQ(*ParseBytes("--x", "1G"), 1u << 30);
  EXPECT_EQ(*ParseBytes("--x", "3TiB"), uint64_t{3} << 40);
  EXPECT_EQ(*ParseBytes("--x", "0"), 0u);
}

TEST(ByteUnitsTest, RefusesNamingTheSettingAndTheText) {
  for (const char* bad : {"", "K", "12Q", "1.5G", "-1", "99999999999999999999", "17179869184G"}) {
    auto r = ParseBytes("cpu_bytes", bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("cpu_bytes"));
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(std::string("'") + bad + "'"));
  }
}

TEST(ByteUnitsTest, FormatsWholeMultiplesInTheLargestUnit) {
  EXPECT_EQ(FormatBytes(256 << 10), "256 KiB");
  EXPECT_EQ(FormatBytes(2 << 20), "2 MiB");
  EXPECT_EQ(FormatBytes(uint64_t{1} << 30), "1 GiB");
  EXPECT_EQ(FormatBytes(uint64_t{2} << 40), "2 TiB");
  EXPECT_EQ(FormatBytes(1000), "1000 B");
  EXPECT_EQ(FormatBytes(0), "0 B");
}

}  // namespace
}  // namespace kvstash
