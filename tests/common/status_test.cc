#include "kvstash/common/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <memory>

namespace kvstash {
namespace {

TEST(StatusTest, OkCarriesNothing) {
  Status ok;
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.code(), StatusCode::kOk);
  EXPECT_EQ(ok.message(), "");
  EXPECT_EQ(ok.ToString(), "OK");
}

TEST(StatusTest, FactoriesFormatTheirMessage) {
  Status s = InvalidArgumentError("block of {} bytes exceeds slot size {}", 3145728, 2097152);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.ToString(), "INVALID_ARGUMENT: block of 3145728 bytes exceeds slot size 2097152");
  Status copy = s;
  EXPECT_EQ(copy, s);
  EXPECT_NE(copy, NotFoundError("block of 3145728 bytes exceeds slot size 2097152"));
}

TEST(StatusTest, ErrnoIsTranslated) {
  EXPECT_EQ(FromErrno(ENOSPC, "write").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(FromErrno(ENOENT, "open /x").code(), StatusCode::kNotFound);
  EXPECT_EQ(FromErrno(ENOENT, "open /x").message(), "open /x: No such file or directory");
  EXPECT_TRUE(FromErrno(0, "nothing").ok());
}

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError("{} is odd", x);
  return x / 2;
}

Result<int> Quarter(int x) {
  KVSTASH_ASSIGN_OR_RETURN(int half, Half(x));
  KVSTASH_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

Status CheckEven(int x) {
  KVSTASH_RETURN_IF_ERROR(Half(x).status());
  return Status::OK();
}

TEST(ResultTest, HoldsValueOrStatus) {
  EXPECT_EQ(*Quarter(8), 2);
  Result<int> odd = Quarter(6);
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.status().message(), "3 is odd");
  EXPECT_TRUE(CheckEven(4).ok());
  EXPECT_EQ(CheckEven(5).code(), StatusCode::kInvalidArgument);
  Result<int> from_ok = Status::OK();  // a bug in the caller: becomes Internal, never "ok"
  EXPECT_FALSE(from_ok.ok());
  EXPECT_EQ(from_ok.status().code(), StatusCode::kInternal);
}

TEST(ResultTest, HoldsMoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(5);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 5);
}

}  // namespace
}  // namespace kvstash
