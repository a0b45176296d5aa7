// The vLLM schema's encoding (byte for byte, against msgpack written by hand from vLLM's
// structs), its decoding in both of msgspec's layouts, and hostile bytes.
#include "kvstash/events/kv_events.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace kvstash::events {
namespace {

using ::testing::HasSubstr;

std::span<const std::byte> Bytes(const std::string& s) { return std::as_bytes(std::span(s)); }

std::string Hex(const std::string& s) {
  std::string out;
  for (unsigned char c : s) out += fmt::format("{:02x}", c);
  return out;
}

std::string Unhex(std::string_view hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  }
  return out;
}

TEST(KvEventsTest, EncodesABatchAsVllmsMsgspecDoes) {
  // KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[1, b"\x01\x02"],
  // parent_block_hash=None, token_ids=[7, 300], block_size=16, lora_id=None, medium="CPU",
  // lora_name=None, group_idx=2, kv_cache_spec_kind="sliding_window",
  // kv_cache_spec_sliding_window=128), BlockRemoved(block_hashes=[5], medium="SSD"),
  // AllBlocksCleared()], data_parallel_rank=0), array_like: every struct an array, the tag
  // first, trailing defaults left out.
  KvEventBatch batch;
  batch.ts = 1.5;
  BlockStored stored;
  stored.block_hashes = {uint64_t{1}, std::string("\x01\x02", 2)};
  stored.token_ids = {7, 300};
  stored.block_size = 16;
  stored.medium = "CPU";
  stored.group_idx = 2;
  stored.kv_cache_spec_kind = "sliding_window";
  stored.kv_cache_spec_sliding_window = 128;
  BlockRemoved removed;
  removed.block_hashes = {uint64_t{5}};
  removed.medium = "SSD";
  batch.events = {stored, removed, AllBlocksCleared{}};
  batch.data_parallel_rank = 0;
  const std::string expected =
      "93"                  // [ts, events, data_parallel_rank]
      "cb3ff8000000000000"  // 1.5 as float64
      "93"                  // three events
      "9c"                  // BlockStored: tag + 11 fields
      "ab426c6f636b53746f726564"
      "92"
      "01"
      "c4020102"  // [1, b"\x01\x02"]
      "c0"        // parent None
      "92"
      "07"
      "cd012c"    // [7, 300]
      "10"        // 16
      "c0"        // lora_id None
      "a3435055"  // "CPU"
      "c0"        // lora_name None
      "c0"        // extra_keys None (not trailing: later fields are set)
      "02"        // group_idx
      "ae736c6964696e675f77696e646f77"
      "cc80"  // 128
      "93"    // BlockRemoved: tag + 2 fields (group_idx None, trailing)
      "ac426c6f636b52656d6f766564"
      "91"
      "05"
      "a3535344"
      "91"  // AllBlocksCleared: tag alone
      "b0416c6c426c6f636b73436c6561726564"
      "00";  // data_parallel_rank
  EXPECT_EQ(Hex(EncodeBatch(batch)), expected);

  Result<KvEventBatch> back = DecodeBatch(Bytes(EncodeBatch(batch)));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, batch);
}

TEST(KvEventsTest, TrailingDefaultsAreLeftOutAndReadBackAsDefaults) {
  KvEventBatch batch;
  batch.ts = 2;
  BlockStored stored;  // vLLM's CPU tier: no parent, no tokens, block size 0
  stored.block_hashes = {uint64_t{9}};
  stored.medium = "CPU";
  batch.events = {stored};
  const std::string bytes = EncodeBatch(batch);
  // [ts, [[tag, hashes, parent, tokens, size, lora_id, medium, lora_name]]]: 8 elements, no
  // rank.
  EXPECT_EQ(Hex(bytes).substr(0, 2), "92");
  EXPECT_THAT(Hex(bytes), HasSubstr("98ab426c6f636b53746f726564"));
  Result<KvEventBatch> back = DecodeBatch(Bytes(bytes));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, batch);
  EXPECT_FALSE(std::get<BlockStored>(back->events[0]).group_idx.has_value());
}

TEST(KvEventsTest, ReadsTheMapLayoutOfMsgspecWithoutArrayLike) {
  // {"ts": 3.0, "events": [{"type": "BlockRemoved", "block_hashes": [-1], "medium": "GPU",
  //  "group_idx": 1}, {"type": "AllBlocksCleared"}], "data_parallel_rank": 2, "extra": 1}
  const std::string bytes = Unhex(
      "84"
      "a27473"
      "cb4008000000000000"
      "a66576656e7473"
      "92"
      "84"
      "a474797065"
      "ac426c6f636b52656d6f766564"
      "ac626c6f636b5f686173686573"
      "91"
      "ff"
      "a66d656469756d"
      "a3475055"
      "a967726f75705f696478"
      "01"
      "81"
      "a474797065"
      "b0416c6c426c6f636b73436c6561726564"
      "b2646174615f706172616c6c656c5f72616e6b"
      "02"
      "a56578747261"
      "01");
  Result<KvEventBatch> batch = DecodeBatch(Bytes(bytes));
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();
  EXPECT_EQ(batch->ts, 3.0);
  ASSERT_EQ(batch->events.size(), 2u);
  const auto& removed = std::get<BlockRemoved>(batch->events[0]);
  EXPECT_EQ(removed.block_hashes, std::vector<ExternalHash>{~uint64_t{0}});
  EXPECT_EQ(removed.medium, "GPU");
  EXPECT_EQ(removed.group_idx, 1);
  EXPECT_TRUE(std::holds_alternative<AllBlocksCleared>(batch->events[1]));
  EXPECT_EQ(batch->data_parallel_rank, 2);
}

TEST(KvEventsTest, RefusesWhatIsNotABatchWithAReason) {
  struct Case {
    const char* hex;
    const char* why;
  };
  const Case cases[] = {
      {"", "ends early"},
      {"c1", "not msgpack"},
      {"92cb3ff0000000000000", "ends early"},                     // events missing
      {"dd7fffffff", "declares"},                                 // 2^31 elements, no bytes
      {"92cb3ff000000000000091dfffffffff", "declares"},           // a map claiming 2^32 pairs
      {"92cb3ff00000000000009191a3466f6f", "unknown event tag"},  // ["Foo"]
      {"92cb3ff00000000000009192ac426c6f636b52656d6f766564c0", "not an array"},
      {"92cb3ff0000000000000909090", "after the batch"},  // trailing objects
      {"92a2747390", "ts"},                               // ts a string
      {"92a090", "ts"},
  };
  for (const Case& c : cases) {
    Result<KvEventBatch> r = DecodeBatch(Bytes(Unhex(c.hex)));
    ASSERT_FALSE(r.ok()) << c.hex;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.hex;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.why)) << c.hex;
  }
  // Nested deeper than any batch needs.
  std::string deep(200, '\x91');
  deep += '\xc0';
  Result<KvEventBatch> r = DecodeBatch(Bytes(deep));
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("nested"));
  // Over the size limit, refused unread.
  r = DecodeBatch(Bytes(std::string(100, '\x90')), 64);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("over the limit"));
}

TEST(KvEventsTest, RandomAndMutatedBytesNeverCrashTheDecoder) {
  KvEventBatch batch;
  batch.ts = 1;
  BlockStored stored;
  stored.block_hashes = {uint64_t{1}, uint64_t{2}};
  stored.token_ids = {1, 2, 3};
  stored.medium = "CPU";
  stored.group_idx = 0;
  batch.events = {stored, BlockRemoved{{uint64_t{1}}, "CPU", 0}, AllBlocksCleared{}};
  const std::string good = EncodeBatch(batch);
  std::mt19937_64 rng(7);
  size_t accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string bytes = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) bytes[rng() % bytes.size()] = static_cast<char>(rng());
    if (rng() % 4 == 0) bytes.resize(rng() % bytes.size());
    if (DecodeBatch(Bytes(bytes)).ok()) ++accepted;
  }
  // Some mutations keep it a valid batch (a hash's value, a token): the point is that none
  // crashed, and that not everything was accepted.
  EXPECT_LT(accepted, 20000u);
}

TEST(KvEventsTest, RunsEncodeAsTheEventsTheyStandFor) {
  const std::vector<Hash128> hashes = {{.lo = 5, .hi = 0}, {.lo = 0x0f, .hi = 0x01}};
  const BlockRun runs[] = {
      {BlockRun::Kind::kAllCleared, {}, 0, {}, std::nullopt, 0},
      {BlockRun::Kind::kStored, kMediumCpu, 3, hashes, std::nullopt, 0},
      {BlockRun::Kind::kRemoved, kMediumSsd, 0, std::span(hashes).first(1), std::nullopt, 0},
  };
  BlockStored stored;
  stored.block_hashes = {uint64_t{5}, ExternalHashOf(hashes[1])};
  stored.medium = "CPU";
  stored.group_idx = 3;
  const KvEventBatch batch{
      4.25, {AllBlocksCleared{}, stored, BlockRemoved{{uint64_t{5}}, "SSD", 0}}, std::nullopt};
  EXPECT_EQ(Hex(EncodeRuns(4.25, runs)), Hex(EncodeBatch(batch)));
  EXPECT_EQ(std::get<std::string>(ExternalHashOf(hashes[1])),
            std::string("\0\0\0\0\0\0\0\x01\0\0\0\0\0\0\0\x0f", 16));
}

// A run of a chain the client described (PutBlock's BlockMeta): its parent, a narrow or a wide
// hash, and its block size go where vLLM's BlockStored has them.
TEST(KvEventsTest, AStoredRunCarriesItsParentAndBlockSize) {
  const std::vector<Hash128> hashes = {{.lo = 7, .hi = 0}, {.lo = 8, .hi = 0}};
  const Hash128 wide{.lo = 0x0f, .hi = 0x01};
  const BlockRun runs[] = {
      {BlockRun::Kind::kStored, kMediumCpu, 1, hashes, Hash128{.lo = 6, .hi = 0}, 16},
      {BlockRun::Kind::kStored, kMediumCpu, 1, std::span(hashes).first(1), wide, 32},
      {BlockRun::Kind::kStored, kMediumSsd, 2, std::span(hashes).last(1), std::nullopt, 64},
  };
  BlockStored chained;
  chained.block_hashes = {uint64_t{7}, uint64_t{8}};
  chained.parent_block_hash = uint64_t{6};
  chained.block_size = 16;
  chained.medium = "CPU";
  chained.group_idx = 1;
  BlockStored under_wide = chained;
  under_wide.block_hashes = {uint64_t{7}};
  under_wide.parent_block_hash = ExternalHashOf(wide);
  under_wide.block_size = 32;
  BlockStored first;  // a request's first block: no parent, its size still said
  first.block_hashes = {uint64_t{8}};
  first.block_size = 64;
  first.medium = "SSD";
  first.group_idx = 2;
  const KvEventBatch batch{1.5, {chained, under_wide, first}, std::nullopt};
  const std::string bytes = EncodeRuns(1.5, runs);
  EXPECT_EQ(Hex(bytes), Hex(EncodeBatch(batch)));
  auto decoded = DecodeBatch(Bytes(bytes));
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(*decoded, batch);
}

TEST(KvEventsTest, SequenceNumbersAreEightBytesBigEndian) {
  EXPECT_EQ(Hex(EncodeSequence(258)), "0000000000000102");
  EXPECT_EQ(Hex(EncodeSequence(-1)), "ffffffffffffffff");
  EXPECT_EQ(*DecodeSequence(Bytes(EncodeSequence(1234567))), 1234567);
  EXPECT_EQ(DecodeSequence(Bytes(std::string(7, '\0'))).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvstash::events
