#include "block_load.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "kvstash/common/hash.h"

namespace kvstash::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Block content. Each client keeps --batch send buffers; buffer j holds a pattern (64-bit
// words start + i * step, start drawn from the client and j), and a put of key k goes from
// buffer k % batch after the key is stamped into the first word of every 4 KiB page. So a put
// writes only the stamps. Every read checks every page's stamp and last word (a block read
// back under the wrong key, stale, shifted, or torn at any page fails: 2 words of 512); every
// --check-every'th read checks every word (a byte corrupted anywhere fails). A check of every
// word of every read would cost more than half a copy, whose bytes it reads again.
constexpr uint64_t kStep = 0x9e3779b97f4a7c15ULL;
constexpr size_t kPageWords = 512;

// Four words at a time in GCC/Clang vector types: -O2's cost model does not vectorise these
// loops by itself, and at 1 word per step the generator would cost as much as the transfer.
using Words4 = uint64_t __attribute__((vector_size(32)));
constexpr Words4 kStep4 = {4 * kStep, 4 * kStep, 4 * kStep, 4 * kStep};

uint64_t PatternStart(uint64_t key, size_t batch) {
  return Mix64(((key >> 40) << 20) ^ (key % batch) ^ 0x6b76737461736800ULL);
}
uint64_t Stamp(uint64_t key, size_t page) { return Mix64(key + page * kStep); }

// Words [from, to) of the pattern that starts at `start`.
void FillPattern(uint64_t start, uint64_t* words, size_t from, size_t to) {
  size_t i = from;
  Words4 v = {start + i * kStep, start + (i + 1) * kStep, start + (i + 2) * kStep,
              start + (i + 3) * kStep};
  for (; i + 4 <= to; i += 4, v += kStep4) std::memcpy(words + i, &v, sizeof v);
  for (; i < to; ++i) words[i] = start + i * kStep;
}

// OR of the differences between words [from, to) and the pattern.
uint64_t PatternDiff(uint64_t start, const uint64_t* words, size_t from, size_t to) {
  size_t i = from;
  Words4 v = {start + i * kStep, start + (i + 1) * kStep, start + (i + 2) * kStep,
              start + (i + 3) * kStep};
  Words4 diff = {0, 0, 0, 0};
  for (; i + 4 <= to; i += 4, v += kStep4) {
    Words4 got;
    std::memcpy(&got, words + i, sizeof got);
    diff |= got ^ v;
  }
  uint64_t rest = diff[0] | diff[1] | diff[2] | diff[3];
  for (; i < to; ++i) rest |= words[i] ^ (start + i * kStep);
  return rest;
}

// A send buffer's pattern (once per buffer), then per put: the key's stamps.
void FillBuffer(uint64_t any_key_of_buffer, size_t batch, std::span<uint64_t> words) {
  FillPattern(PatternStart(any_key_of_buffer, batch), words.data(), 0, words.size());
}
void StampKey(uint64_t key, std::span<uint64_t> words) {
  for (size_t p = 0; p * kPageWords < words.size(); ++p) words[p * kPageWords] = Stamp(key, p);
}

struct Shared {
  std::atomic<uint64_t> puts{0}, gets{0}, errors{0}, mismatches{0};
  std::atomic<bool> stop{false};
};

LoadTotals RunClient(const LoadSettings& settings, int id, BlockConnection& connection,
                     Shared& shared) {
  LoadTotals totals;
  const uint64_t block_bytes = settings.block_bytes;
  std::mt19937_64 random(static_cast<uint64_t>(id) * 7919 + 1);
  const size_t batch = static_cast<size_t>(settings.batch);
  // --batch send buffers (patterns made once, stamped per put) and --batch receive buffers,
  // in whole words (block sizes are multiples of 4 KiB).
  const size_t words_per_block = block_bytes / 8;
  std::vector<uint64_t> send_words(words_per_block * batch), recv_words(words_per_block * batch);
  std::vector<std::span<uint64_t>> sends, recvs;
  std::vector<std::span<std::byte>> outs;
  std::vector<std::span<const std::byte>> ins;
  const uint64_t first_key = static_cast<uint64_t>(id + 1) << 40;
  for (size_t b = 0; b < batch; ++b) {
    sends.push_back(std::span(send_words).subspan(b * words_per_block, words_per_block));
    recvs.push_back(std::span(recv_words).subspan(b * words_per_block, words_per_block));
    ins.push_back(std::as_bytes(sends.back()));
    outs.push_back(std::as_writable_bytes(recvs.back()));
  }
  // Buffer j holds the pattern of the keys k with k % batch == j.
  for (size_t b = 0; b < batch; ++b) {
    FillBuffer(first_key + b, batch, sends[(first_key + b) % batch]);
  }
  std::vector<uint64_t> keys(batch);
  // The client's most recent --keys-per-client stored keys (a ring): reads pick among them.
  std::vector<uint64_t> stored;
  size_t next_slot = 0;
  uint64_t sequence = settings.first_sequence;
  uint64_t reads = 0;  // blocks read back, for --check-every
  while (!shared.stop.load(std::memory_order_relaxed)) {
    const bool read = !stored.empty() &&
                      std::uniform_real_distribution<double>(0, 1)(random) < settings.read_share;
    const auto start = Clock::now();
    if (read) {
      for (uint64_t& key : keys) key = stored[random() % stored.size()];
      const std::vector<Result<size_t>> got = connection.Get(keys, outs);
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      uint64_t read_ok = 0;
      for (size_t b = 0; b < batch; ++b) {
        if (!got[b].ok()) {
          // An evicted block is a miss, not an error: the stores are caches.
          if (got[b].status().code() == StatusCode::kNotFound) {
            ++totals.misses;
          } else {
            if (totals.errors++ == 0) totals.first_error = got[b].status().ToString();
            shared.errors.fetch_add(1);
          }
          continue;
        }
        const bool whole = ++reads % static_cast<uint64_t>(settings.check_every) == 0;
        if (*got[b] != block_bytes ||
            !(whole ? Matches(keys[b], batch, recvs[b]) : StampsMatch(keys[b], batch, recvs[b]))) {
          ++totals.mismatches;
          shared.mismatches.fetch_add(1);
        }
        ++read_ok;
      }
      totals.gets += read_ok;
      shared.gets.fetch_add(read_ok);
      totals.get_us.push_back(us);
    } else {
      // New keys every time, as an engine offloads new blocks: every put moves its bytes, and
      // the stores evict the oldest when full.
      // Keys first_key + sequence, batch at a time: key k goes from buffer k % batch.
      std::vector<std::span<const std::byte>> order(batch);
      for (size_t b = 0; b < batch; ++b) {
        keys[b] = first_key | sequence++;
        const size_t buffer = keys[b] % batch;
        StampKey(keys[b], sends[buffer]);
        order[b] = ins[buffer];
      }
      const Status put = connection.Put(keys, order);
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      if (!put.ok()) {
        if (totals.errors++ == 0) totals.first_error = put.ToString();
        shared.errors.fetch_add(1);
        continue;
      }
      for (const uint64_t key : keys) {
        if (stored.size() < static_cast<size_t>(settings.keys_per_client)) {
          stored.push_back(key);
        } else {
          stored[next_slot++ % stored.size()] = key;
        }
      }
      totals.puts += batch;
      shared.puts.fetch_add(batch);
      totals.put_us.push_back(us);
    }
  }
  return totals;
}

}  // namespace

double LoadTotals::PutGbps(uint64_t block_bytes) const {
  return seconds > 0 ? static_cast<double>(puts * block_bytes) / seconds / 1e9 : 0.0;
}

double LoadTotals::GetGbps(uint64_t block_bytes) const {
  return seconds > 0 ? static_cast<double>(gets * block_bytes) / seconds / 1e9 : 0.0;
}

void LoadTotals::Add(const LoadTotals& other) {
  puts += other.puts;
  gets += other.gets;
  misses += other.misses;
  errors += other.errors;
  mismatches += other.mismatches;
  if (first_error.empty()) first_error = other.first_error;
  put_us.insert(put_us.end(), other.put_us.begin(), other.put_us.end());
  get_us.insert(get_us.end(), other.get_us.begin(), other.get_us.end());
  seconds += other.seconds;
}

Result<LoadTotals> RunLoad(const LoadSettings& settings, const Connect& connect,
                           const LoadTick& tick) {
  Shared shared;
  std::vector<LoadTotals> totals(settings.clients);
  std::vector<std::string> failures(settings.clients);
  std::vector<std::thread> threads;
  const auto start = Clock::now();
  for (int i = 0; i < settings.clients; ++i) {
    threads.emplace_back([&, i] {
      Result<std::unique_ptr<BlockConnection>> connection = connect(i);
      if (!connection.ok()) {
        failures[i] = std::string(connection.status().message());
        return;
      }
      totals[i] = RunClient(settings, i, **connection, shared);
    });
  }
  const auto end = start + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(settings.seconds));
  bool cancelled = false;
  while (Clock::now() < end) {
    std::this_thread::sleep_until(std::min(end, Clock::now() + std::chrono::milliseconds(100)));
    if (settings.cancel != nullptr && settings.cancel->load()) {
      cancelled = true;
      break;
    }
    if (tick) {
      tick(LoadCounts{shared.puts.load(), shared.gets.load(), shared.errors.load(),
                      shared.mismatches.load()});
    }
  }
  shared.stop = true;
  for (std::thread& t : threads) t.join();
  const auto elapsed = Clock::now() - start;
  if (cancelled) return CancelledError("interrupted");
  for (const std::string& f : failures) {
    if (!f.empty()) return UnavailableError("{}", f);
  }
  LoadTotals sum;
  for (const LoadTotals& t : totals) sum.Add(t);
  sum.seconds = std::chrono::duration<double>(elapsed).count();
  return sum;
}

void FillBlock(uint64_t key, size_t batch, std::span<uint64_t> words) {
  FillBuffer(key, batch, words);
  StampKey(key, words);
}

// Every page's stamp and last word.
bool StampsMatch(uint64_t key, size_t batch, std::span<const uint64_t> words) {
  const uint64_t start = PatternStart(key, batch);
  uint64_t diff = 0;
  for (size_t p = 0; p * kPageWords < words.size(); ++p) {
    const size_t first = p * kPageWords;
    const size_t last = std::min(words.size(), first + kPageWords) - 1;
    diff |= words[first] ^ Stamp(key, p);
    if (last != first) diff |= words[last] ^ (start + last * kStep);
  }
  return diff == 0;
}

// Every word.
bool Matches(uint64_t key, size_t batch, std::span<const uint64_t> words) {
  const uint64_t start = PatternStart(key, batch);
  uint64_t diff = 0;
  for (size_t p = 0; p * kPageWords < words.size(); ++p) {
    const size_t first = p * kPageWords;
    diff |= words[first] ^ Stamp(key, p);
    diff |= PatternDiff(start, words.data(), first + 1, std::min(words.size(), first + kPageWords));
  }
  return diff == 0;
}

Status CheckTheChecks(uint64_t block_bytes) {
  std::vector<uint64_t> words(block_bytes / 8);
  FillBlock(41, 1, words);
  bool sound = Matches(41, 1, words) && !Matches(42, 1, words) && StampsMatch(41, 1, words) &&
               !StampsMatch(42, 1, words);
  const auto bytes = std::as_writable_bytes(std::span(words));
  for (size_t at : {size_t{0}, size_t{9}, block_bytes / 2, block_bytes - 1}) {
    bytes[at] ^= std::byte{1};
    sound = sound && !Matches(41, 1, words);
    bytes[at] ^= std::byte{1};
  }
  if (!sound) return InternalError("internal error: the block content check is broken");
  return Status::OK();
}

}  // namespace kvstash::bench
