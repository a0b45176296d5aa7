// kvstash's log lines quote what a peer sent, escaped ({:?}; the node's refusal of a client,
// transport/ucx/src/rpc_server_connections.cc), and a name cut short or not UTF-8 can end in half
// a character. Built by clang, formatting such a string aborted in fmt ("core.h:405: assertion
// failed: negative value") in a program that has no copies of fmt's templates of its own: it
// took them from libspdlog, which Debian's package exports and which comes first in the link
// order, and they are not the ones libfmt expects. Found by the hello fuzz target
// (tests/fuzz/corpus/hello/crash-half-a-character); CMakeLists.txt links libfmt first under
// clang. A GCC build is not affected (it keeps copies of its own), so there this always passes.
// This program links libspdlog but makes no log call, which would bring copies of its own.

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <string_view>

namespace kvstash {
namespace {

TEST(FmtQuotingTest, QuotesAStringEndingInHalfACharacter) {
  const std::string sent = "host/4242/engin\xcf";
  EXPECT_EQ(fmt::format("{:?}", sent), "\"host/4242/engin\\xcf\"");
  EXPECT_EQ(fmt::format("{:?}", std::string_view("tenant-\xc3\xa9").substr(0, 8)),
            "\"tenant-\\xc3\"");
}

}  // namespace
}  // namespace kvstash
