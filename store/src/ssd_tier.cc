// The SSD tier: block slots in one file, a RocksDB index of small records.
//
// Why this layout (measured on the development VM, 1 GiB of 256 KiB and 2 MiB values, RocksDB
// 7.8.3, against fio psync direct sequential I/O on the same file system, which gave 1.3-2.9
// GB/s write and 0.9-2.0 GB/s read):
//   - BlobDB (enable_blob_files, direct reads and flush I/O): 0.31-0.43 GB/s write with the WAL
//     (it writes every value twice), 0.42-0.68 GB/s without it (memtable stalls: the single
//     flush thread writes the blob files), 0.21-0.52 GB/s read. 15-45% of fio.
//   - Plain RocksDB values: 0.17-0.71 GB/s write, reads only fast through the page cache.
//   - Slots written and read with one pwrite/pread each under O_DIRECT, plus a 40-byte index
//     record per block through RocksDB's WAL: the bytes reach the disk once, in the caller's
//     buffer, and the tier runs at the disk's rate (`kvstash bench ssd` prints the ratio to fio).
// So RocksDB does what it is good at (a crash-safe, compacted index of small records) and the
// block bytes bypass it.
#include "kvstash/store/ssd_tier.h"

#include <fcntl.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>
#if defined(__x86_64__)
// XXH3 with the widest vector unit the CPU has (AVX2/AVX-512: 4x SSE2's speed on 256 KiB
// blocks here), chosen at run time; the hash values are the same on every machine.
#include <xxh_x86dispatch.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>

#include "kvstash/common/logging.h"
#include "kvstash/common/mutex.h"

namespace kvstash::store {
namespace {

constexpr size_t kIoAlignment = 4096;
constexpr size_t kMaxBlockBytes = size_t{1} << 30;
constexpr uint32_t kRecordFormat = 1;
constexpr char kBlockPrefix = 'b';
const std::string kMetaKey = "meta";

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

Status FromRocks(const rocksdb::Status& s, std::string_view what) {
  if (s.ok()) return Status::OK();
  StatusCode code = StatusCode::kInternal;
  if (s.IsNoSpace()) {
    code = StatusCode::kResourceExhausted;
  } else if (s.IsCorruption()) {
    code = StatusCode::kDataLoss;
  } else if (s.IsIOError() || s.IsBusy() || s.IsTryAgain()) {
    code = StatusCode::kUnavailable;
  } else if (s.IsInvalidArgument() || s.IsNotSupported()) {
    code = StatusCode::kInvalidArgument;
  } else if (s.IsNotFound()) {
    code = StatusCode::kNotFound;
  }
  return Status(code, fmt::format("{}: {}", what, s.ToString()));
}

void PutBe32(char* p, uint32_t v) {
  for (int i = 3; i >= 0; --i, v >>= 8) p[i] = static_cast<char>(v & 0xff);
}
void PutBe64(char* p, uint64_t v) {
  for (int i = 7; i >= 0; --i, v >>= 8) p[i] = static_cast<char>(v & 0xff);
}
uint32_t GetBe32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}
uint64_t GetBe64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// Index key: 'b', namespace, group, hash hi, hash lo; big-endian, so a scan is in key order.
constexpr size_t kIndexKeyBytes = 25;
std::string EncodeKey(const BlockKey& key) {
  std::string out(kIndexKeyBytes, '\0');
  out[0] = kBlockPrefix;
  PutBe32(&out[1], key.namespace_id);
  PutBe32(&out[5], key.group);
  PutBe64(&out[9], key.hash.hi);
  PutBe64(&out[17], key.hash.lo);
  return out;
}
bool DecodeKey(std::string_view bytes, BlockKey* key) {
  if (bytes.size() != kIndexKeyBytes || bytes[0] != kBlockPrefix) return false;
  key->namespace_id = GetBe32(&bytes[1]);
  key->group = GetBe32(&bytes[5]);
  key->hash.hi = GetBe64(&bytes[9]);
  key->hash.lo = GetBe64(&bytes[17]);
  return true;
}

// What the tier knows of a committed slot.
struct SlotRecord {
  uint32_t length = 0;
  uint64_t seq = 0;       // write order, unique per tier; restores recency and settles slot reuse
  uint64_t checksum = 0;  // BlockChecksum of the bytes
};

// Index value: format, slot, length, seq, checksum, then xxh3-64 of those 28 bytes.
constexpr size_t kRecordBytes = 36;
std::string EncodeRecord(SlotId slot, const SlotRecord& r) {
  std::string out(kRecordBytes, '\0');
  PutBe32(&out[0], kRecordFormat);
  PutBe32(&out[4], slot);
  PutBe32(&out[8], r.length);
  PutBe64(&out[12], r.seq);
  PutBe64(&out[20], r.checksum);
  PutBe64(&out[28], XXH3_64bits(out.data(), 28));
  return out;
}
bool DecodeRecord(std::string_view bytes, SlotId* slot, SlotRecord* r) {
  if (bytes.size() != kRecordBytes || GetBe32(&bytes[0]) != kRecordFormat) return false;
  if (GetBe64(&bytes[28]) != XXH3_64bits(bytes.data(), 28)) return false;
  *slot = GetBe32(&bytes[4]);
  r->length = GetBe32(&bytes[8]);
  r->seq = GetBe64(&bytes[12]);
  r->checksum = GetBe64(&bytes[20]);
  return true;
}

// xxh3-64 of the bytes, seeded with the key and the sequence number: bytes left in a slot by
// an earlier block, or by a torn write of a later one, do not match the record. The disk's
// copy only: docs/semantics.md §18 lists the other checksums.
uint64_t BlockChecksum(const BlockKey& key, uint64_t seq, std::span<const std::byte> data) {
  char seed_bytes[kIndexKeyBytes + 8];
  const std::string k = EncodeKey(key);
  std::memcpy(seed_bytes, k.data(), kIndexKeyBytes);
  PutBe64(seed_bytes + kIndexKeyBytes, seq);
  return XXH3_64bits_withSeed(data.data(), data.size(), XXH3_64bits(seed_bytes, sizeof seed_bytes));
}

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};
using AlignedBytes = std::unique_ptr<std::byte, FreeDeleter>;

AlignedBytes AllocateAligned(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kIoAlignment, bytes) != 0) return nullptr;
  return AlignedBytes(static_cast<std::byte*>(p));
}

bool IsAligned(const void* p, size_t n) {
  return reinterpret_cast<uintptr_t>(p) % kIoAlignment == 0 && n % kIoAlignment == 0;
}

// A per-thread bounce buffer for blocks whose buffer or length does not suit direct I/O.
std::byte* BounceBuffer(size_t bytes) {
  thread_local AlignedBytes buffer;
  thread_local size_t size = 0;
  if (size < bytes) {
    buffer = AllocateAligned(bytes);
    size = buffer ? bytes : 0;
  }
  return buffer.get();
}

Status WriteFully(int fd, const std::byte* p, size_t n, uint64_t offset) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return FromErrno(errno, fmt::format("write of {} bytes at offset {}", n, offset));
    }
    if (w == 0) return UnavailableError("write at offset {} made no progress", offset);
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return Status::OK();
}

// Returns the bytes read, short only at end of file.
Result<size_t> ReadFully(int fd, std::byte* p, size_t n, uint64_t offset) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, p + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return FromErrno(errno, fmt::format("read of {} bytes at offset {}", n, offset));
    }
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  return done;
}

}  // namespace

struct SsdTier::Impl {
  SsdTierOptions options;
  std::unique_ptr<rocksdb::DB> db;
  int fd = -1;
  // Written by the thread that holds the slot reserved (PrepareStore .. WriteAndCommit), read by
  // threads that hold it pinned; the index's lock orders the two.
  std::vector<SlotRecord> slots;
  std::atomic<uint64_t> next_seq{1};
  // Serializes index record writes and deletes with the index changes they reflect, so that a
  // record deleted for an evicted block never deletes a newer record of the same key.
  Mutex records_mu;

  std::atomic<uint64_t> blocks_written{0}, bytes_written{0}, blocks_read{0}, bytes_read{0},
      write_failures{0}, checksum_failures{0}, read_errors{0}, evictions{0};
  uint64_t restored_blocks = 0, dropped_records = 0;

  ~Impl() {
    if (fd >= 0) ::close(fd);
    if (db) {
      db->Close().PermitUncheckedError();
    }
  }

  rocksdb::WriteOptions WriteOpts() const {
    rocksdb::WriteOptions w;
    w.sync = options.sync;
    return w;
  }
};

namespace {

// RocksDB's messages, in kvstash's log instead of a LOG file in the index directory.
//
// RocksDB's own info log (EnvLogger, RocksDB 7.8) writes to a file on the SSD tier's disk, and
// after a failed write (a full disk) it writes again; Debian's librocksdb is built with
// assertions, where WritableFileWriter::AssertFalseAndGetStatusForPrevError then aborts the
// process. DB::Open logs its build version first, so a node restarted on a full disk died in
// DB::Open (exit 134) instead of getting "No space left" as a Status. A logger that writes no
// file has no such error, and the messages reach the operator with the node's own.
//
// Thread-safe (RocksDB logs from its background threads; spdlog serializes).
class IndexLogger : public rocksdb::Logger {
 public:
  explicit IndexLogger(std::string path)
      : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL), path_(std::move(path)) {}

  // RocksDB calls this overload for INFO lines of the default implementation; every
  // overload must be ours (the base one asserts).
  void Logv(const char* format, va_list ap) override {
    Logv(rocksdb::InfoLogLevel::INFO_LEVEL, format, ap);
  }
  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override {
    // The header (build version, options) is for LOG files.
    if (level < GetInfoLogLevel() || level == rocksdb::InfoLogLevel::HEADER_LEVEL) return;
    char line[1024];
    std::vsnprintf(line, sizeof line, format, ap);
    if (level >= rocksdb::InfoLogLevel::ERROR_LEVEL) {
      KVSTASH_LOG_ERROR("SSD index {}: RocksDB: {}", path_, line);
    } else if (level == rocksdb::InfoLogLevel::WARN_LEVEL) {
      KVSTASH_LOG_WARN("SSD index {}: RocksDB: {}", path_, line);
    } else {
      KVSTASH_LOG_DEBUG("SSD index {}: RocksDB: {}", path_, line);
    }
  }
  void LogHeader(const char*, va_list) override {}

 private:
  const std::string path_;
};

rocksdb::Options IndexOptions(const std::string& path) {
  rocksdb::Options o;
  o.create_if_missing = true;
  // The index is small (36-byte values): small memtables, no compression, few files.
  o.write_buffer_size = 8 << 20;
  o.max_write_buffer_number = 2;
  o.max_total_wal_size = 64 << 20;
  o.compression = rocksdb::kNoCompression;
  o.max_open_files = 64;
  o.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  o.info_log = std::make_shared<IndexLogger>(path);
  o.paranoid_checks = true;
  // No multi-megabyte preallocation of the log and manifest: the index stays small, and a
  // nearly full disk should fail block writes, not the index.
  o.allow_fallocate = false;
  o.manifest_preallocation_size = 64 << 10;
  o.wal_recovery_mode = rocksdb::WALRecoveryMode::kPointInTimeRecovery;
  return o;
}

Result<std::unique_ptr<rocksdb::DB>> OpenIndex(const std::string& path) {
  const rocksdb::Options options = IndexOptions(path);
  // RocksDB makes the directory itself, but reads it first for its file summary, which (with
  // no LOG file to make it) would log a missing directory as an error.
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, path, &raw);
  if (s.IsCorruption()) {
    KVSTASH_LOG_WARN(
        "SSD index {} is corrupt ({}); repairing it: records that cannot be read "
        "are lost, their blocks read as misses",
        path, s.ToString());
    rocksdb::Status r = rocksdb::RepairDB(path, options);
    if (!r.ok()) return FromRocks(r, fmt::format("repair of SSD index {}", path));
    s = rocksdb::DB::Open(options, path, &raw);
  }
  if (!s.ok()) {
    return FromRocks(s, fmt::format("cannot open SSD index {}{}", path,
                                    s.IsNoSpace() ? " (its file system is full)" : ""));
  }
  return std::unique_ptr<rocksdb::DB>(raw);
}

Result<int> OpenSlotFile(const std::string& path, bool direct, bool* direct_used) {
  *direct_used = false;
  if (direct) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, 0644);
    if (fd >= 0) {
      *direct_used = true;
      return fd;
    }
    if (errno != EINVAL) return FromErrno(errno, fmt::format("cannot open {}", path));
    KVSTASH_LOG_WARN("{}: the file system refuses direct I/O; using buffered I/O", path);
  }
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return FromErrno(errno, fmt::format("cannot open {}", path));
  return fd;
}

}  // namespace

Result<std::unique_ptr<SsdTier>> SsdTier::Create(const SsdTierOptions& options) {
  if (options.dir.empty()) return InvalidArgumentError("the SSD tier needs a directory");
  if (options.block_bytes == 0 || options.block_bytes > kMaxBlockBytes) {
    return InvalidArgumentError("SSD block size {} is outside [1, {}]", options.block_bytes,
                                kMaxBlockBytes);
  }
  const size_t stride = RoundUp(options.block_bytes, kIoAlignment);
  const uint64_t capacity_blocks = options.capacity_bytes / stride;
  if (capacity_blocks == 0 || capacity_blocks > (uint64_t{1} << 31)) {
    return InvalidArgumentError(
        "SSD capacity of {} bytes holds {} blocks of {} bytes (slots of {}); it must hold 1 to "
        "2^31",
        options.capacity_bytes, capacity_blocks, options.block_bytes, stride);
  }
  std::error_code ec;
  std::filesystem::create_directories(options.dir, ec);
  if (ec) return UnavailableError("cannot create SSD directory {}: {}", options.dir, ec.message());

  auto impl = std::make_unique<Impl>();
  impl->options = options;
  KVSTASH_ASSIGN_OR_RETURN(impl->db, OpenIndex(options.dir + "/index"));
  rocksdb::DB& db = *impl->db;

  // The block size a directory was created with.
  std::string meta;
  rocksdb::Status s = db.Get(rocksdb::ReadOptions(), kMetaKey, &meta);
  if (s.IsNotFound()) {
    meta = std::to_string(options.block_bytes);
    KVSTASH_RETURN_IF_ERROR(
        FromRocks(db.Put(impl->WriteOpts(), kMetaKey, meta),
                  fmt::format("cannot initialise SSD index in {}", options.dir)));
  } else if (!s.ok()) {
    return FromRocks(s, fmt::format("cannot read SSD index in {}", options.dir));
  } else if (meta != std::to_string(options.block_bytes)) {
    return InvalidArgumentError("SSD directory {} holds blocks of {} bytes, not {}", options.dir,
                                meta, options.block_bytes);
  }

  bool direct_used = false;
  KVSTASH_ASSIGN_OR_RETURN(
      impl->fd, OpenSlotFile(options.dir + "/blocks.dat", options.direct_io, &direct_used));

  BlockManagerOptions index_options;
  index_options.capacity_blocks = capacity_blocks;
  index_options.policy = options.policy;
  index_options.enable_events = options.enable_events;
  index_options.max_pending_event_keys = options.max_pending_event_keys;
  KVSTASH_ASSIGN_OR_RETURN(std::unique_ptr<BlockManager> index,
                           BlockManager::Create(index_options));
  try {
    impl->slots.resize(capacity_blocks);
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("cannot allocate the records of {} SSD slots", capacity_blocks);
  }

  // Rebuild the index. Two records naming one slot: the later write owns it (the earlier one's
  // delete was lost in a crash); its bytes are the later block's.
  struct Found {
    BlockKey key;
    SlotRecord record;
  };
  std::map<SlotId, Found> by_slot;
  rocksdb::WriteBatch drop;
  uint64_t max_seq = 0;
  {
    std::unique_ptr<rocksdb::Iterator> it(db.NewIterator(rocksdb::ReadOptions()));
    for (it->Seek(std::string(1, kBlockPrefix)); it->Valid(); it->Next()) {
      const std::string_view k(it->key().data(), it->key().size());
      if (k.empty() || k[0] != kBlockPrefix) break;
      BlockKey key;
      SlotId slot = 0;
      SlotRecord record;
      const bool good = DecodeKey(k, &key) &&
                        DecodeRecord({it->value().data(), it->value().size()}, &slot, &record) &&
                        record.length <= options.block_bytes;
      if (good) max_seq = std::max(max_seq, record.seq);
      const bool kept =
          good && (!options.keep_namespace || options.keep_namespace(key.namespace_id));
      if (!kept || slot >= capacity_blocks) {
        drop.Delete(it->key());
        ++impl->dropped_records;
        continue;
      }
      auto [pos, inserted] = by_slot.try_emplace(slot, Found{key, record});
      if (!inserted) {
        const bool newer = record.seq > pos->second.record.seq;
        drop.Delete(EncodeKey(newer ? pos->second.key : key));
        ++impl->dropped_records;
        if (newer) pos->second = Found{key, record};
      }
    }
    KVSTASH_RETURN_IF_ERROR(
        FromRocks(it->status(), fmt::format("cannot scan SSD index in {}", options.dir)));
  }
  if (drop.Count() > 0) {
    KVSTASH_LOG_WARN(
        "SSD tier {}: dropping {} index records (damaged, duplicate slot, beyond "
        "the capacity of {} blocks, or of a namespace the node no longer names)",
        options.dir, drop.Count(), capacity_blocks);
    KVSTASH_RETURN_IF_ERROR(FromRocks(db.Write(impl->WriteOpts(), &drop),
                                      fmt::format("cannot clean SSD index in {}", options.dir)));
  }
  std::vector<std::pair<uint64_t, BlockInfo>> ordered;
  ordered.reserve(by_slot.size());
  for (const auto& [slot, found] : by_slot) {
    impl->slots[slot] = found.record;
    ordered.push_back({found.record.seq, BlockInfo{found.key, slot, 0}});
  }
  std::sort(ordered.begin(), ordered.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<BlockInfo> blocks;
  blocks.reserve(ordered.size());
  for (const auto& [seq, block] : ordered) blocks.push_back(block);
  KVSTASH_RETURN_IF_ERROR(index->Restore(blocks));
  impl->restored_blocks = blocks.size();
  impl->next_seq = max_seq + 1;

  // A smaller capacity than last time: give back the space of the slots beyond it.
  const uint64_t file_bytes = capacity_blocks * stride;
  struct stat st {};
  if (::fstat(impl->fd, &st) == 0 && static_cast<uint64_t>(st.st_size) > file_bytes) {
    if (::ftruncate(impl->fd, static_cast<off_t>(file_bytes)) != 0) {
      KVSTASH_LOG_WARN("SSD tier {}: cannot shrink blocks.dat: {}", options.dir,
                       std::strerror(errno));
    }
  }
  if (options.preallocate) {
    // fallocate(2), not posix_fallocate: where the file system cannot reserve space, glibc's
    // fallback would write every block of the file.
    const int rc = ::fallocate(impl->fd, 0, 0, static_cast<off_t>(file_bytes)) == 0 ? 0 : errno;
    if (rc != 0) {
      KVSTASH_LOG_WARN(
          "SSD tier {}: cannot reserve {} bytes for blocks.dat ({}); it grows as "
          "blocks arrive, and stores fail if the disk fills up",
          options.dir, file_bytes, std::strerror(rc));
    }
  }
  KVSTASH_LOG_INFO("SSD tier {}: {} blocks of {} bytes ({} restored, {} records dropped), {} I/O",
                   options.dir, capacity_blocks, options.block_bytes, impl->restored_blocks,
                   impl->dropped_records, direct_used ? "direct" : "buffered");
  return std::unique_ptr<SsdTier>(
      new SsdTier(std::move(impl), std::move(index), options.block_bytes, stride, direct_used));
}

SsdTier::SsdTier(std::unique_ptr<Impl> impl, std::unique_ptr<BlockManager> index,
                 size_t block_bytes, size_t stride, bool direct_io)
    : impl_(std::move(impl)),
      index_(std::move(index)),
      block_bytes_(block_bytes),
      stride_(stride),
      direct_io_(direct_io) {}

SsdTier::~SsdTier() = default;

Status SsdTier::DeleteRecords(std::span<const BlockKey> keys) {
  if (keys.empty()) return Status::OK();
  rocksdb::WriteBatch batch;
  for (const BlockKey& key : keys) batch.Delete(EncodeKey(key));
  return FromRocks(impl_->db->Write(impl_->WriteOpts(), &batch),
                   fmt::format("cannot delete {} SSD index records", keys.size()));
}

Status SsdTier::PrepareStore(std::span<const BlockKey> keys, StorePlan* plan) {
  MutexLock lock(&impl_->records_mu);
  KVSTASH_RETURN_IF_ERROR(index_->PrepareStore(keys, plan));
  impl_->evictions += plan->evicted.size();
  // If this fails the records stay behind; their checksums no longer match once the slots are
  // reused, so they read as misses and Open drops them.
  Status s = DeleteRecords(plan->evicted);
  if (!s.ok()) KVSTASH_LOG_WARN("SSD tier {}: {}", impl_->options.dir, s.ToString());
  return Status::OK();
}

Status SsdTier::WriteAndCommit(std::span<const SsdWrite> writes) {
  std::vector<BlockKey> keys;
  keys.reserve(writes.size());
  for (const SsdWrite& w : writes) keys.push_back(w.key);
  auto fail = [&](Status s) {
    index_->CompleteStore(keys, false);
    impl_->write_failures += writes.size();
    return s;
  };

  uint64_t bytes = 0;
  for (const SsdWrite& w : writes) {
    if (w.data.size() > block_bytes_) {
      return fail(InvalidArgumentError("block {} has {} bytes; the SSD tier holds at most {}",
                                       w.key.ToString(), w.data.size(), block_bytes_));
    }
    SlotRecord record;
    record.length = static_cast<uint32_t>(w.data.size());
    record.seq = impl_->next_seq.fetch_add(1);
    record.checksum = BlockChecksum(w.key, record.seq, w.data);
    const size_t io_bytes = direct_io_ ? RoundUp(w.data.size(), kIoAlignment) : w.data.size();
    const std::byte* src = w.data.data();
    if (direct_io_ && !IsAligned(src, w.data.size())) {
      std::byte* bounce = BounceBuffer(stride_);
      if (bounce == nullptr) return fail(ResourceExhaustedError("no memory for a bounce buffer"));
      std::memcpy(bounce, src, w.data.size());
      std::memset(bounce + w.data.size(), 0, io_bytes - w.data.size());
      src = bounce;
    }
    Status s = WriteFully(impl_->fd, src, io_bytes, uint64_t{w.slot} * stride_);
    if (!s.ok()) {
      return fail(Status(s.code(), fmt::format("SSD tier {}: block {}: {}", impl_->options.dir,
                                               w.key.ToString(), s.message())));
    }
    impl_->slots[w.slot] = record;
    bytes += w.data.size();
  }
  if (impl_->options.sync && ::fdatasync(impl_->fd) != 0) {
    return fail(FromErrno(errno, fmt::format("SSD tier {}: fdatasync", impl_->options.dir)));
  }
  rocksdb::WriteBatch batch;
  for (const SsdWrite& w : writes) {
    batch.Put(EncodeKey(w.key), EncodeRecord(w.slot, impl_->slots[w.slot]));
  }
  {
    MutexLock lock(&impl_->records_mu);
    rocksdb::Status s = impl_->db->Write(impl_->WriteOpts(), &batch);
    if (!s.ok() && (s.IsNoSpace() || s.IsIOError())) {
      // RocksDB stops writing after an I/O error until resumed; try once (space may be back).
      if (impl_->db->Resume().ok()) s = impl_->db->Write(impl_->WriteOpts(), &batch);
    }
    if (!s.ok()) {
      return fail(FromRocks(s, fmt::format("SSD tier {}: cannot commit {} blocks",
                                           impl_->options.dir, writes.size())));
    }
    index_->CompleteStore(keys, true);
  }
  impl_->blocks_written += writes.size();
  impl_->bytes_written += bytes;
  return Status::OK();
}

Result<size_t> SsdTier::Read(const BlockKey& key, SlotId slot, std::span<std::byte> out) {
  const SlotRecord record = impl_->slots[slot];
  if (out.size() < record.length) {
    return InvalidArgumentError("buffer of {} bytes for a block of {}", out.size(), record.length);
  }
  const size_t io_bytes = direct_io_ ? RoundUp(record.length, kIoAlignment) : record.length;
  std::byte* dst = out.data();
  const bool bounce = direct_io_ && !(IsAligned(dst, 0) && out.size() >= io_bytes);
  if (bounce) {
    dst = BounceBuffer(stride_);
    if (dst == nullptr) return ResourceExhaustedError("no memory for a bounce buffer");
  }
  Result<size_t> got = ReadFully(impl_->fd, dst, io_bytes, uint64_t{slot} * stride_);
  if (!got.ok() || *got < record.length) {
    ++impl_->read_errors;
    return UnavailableError(
        "SSD tier {}: block {} in slot {}: {}", impl_->options.dir, key.ToString(), slot,
        got.ok() ? fmt::format("short read ({} of {} bytes)", *got, record.length)
                 : got.status().ToString());
  }
  if (bounce) std::memcpy(out.data(), dst, record.length);
  const std::span<const std::byte> bytes(out.data(), record.length);
  if (BlockChecksum(key, record.seq, bytes) != record.checksum) {
    ++impl_->checksum_failures;
    return DataLossError("SSD tier {}: block {} in slot {} does not match its checksum",
                         impl_->options.dir, key.ToString(), slot);
  }
  ++impl_->blocks_read;
  impl_->bytes_read += record.length;
  return size_t{record.length};
}

size_t SsdTier::Remove(std::span<const BlockKey> keys) {
  MutexLock lock(&impl_->records_mu);
  std::vector<BlockKey> removed;
  const size_t n = index_->Remove(keys, &removed);
  Status s = DeleteRecords(removed);
  if (!s.ok()) KVSTASH_LOG_WARN("SSD tier {}: {}", impl_->options.dir, s.ToString());
  return n;
}

Status SsdTier::Put(const BlockKey& key, std::span<const std::byte> data) {
  if (data.size() > block_bytes_) {
    return InvalidArgumentError("block {} has {} bytes; the SSD tier holds at most {}",
                                key.ToString(), data.size(), block_bytes_);
  }
  StorePlan plan;
  const BlockKey keys[] = {key};
  KVSTASH_RETURN_IF_ERROR(PrepareStore(keys, &plan));
  if (plan.keys_to_store.empty()) {
    if (index_->Lookup(key) == LookupResult::kRetry) {
      return UnavailableError("block {} is being stored by another caller", key.ToString());
    }
    return Status::OK();
  }
  const SsdWrite write{key, plan.slots[0], data};
  return WriteAndCommit({&write, 1});
}

Status SsdTier::Get(const BlockKey& key, std::vector<std::byte>* out) {
  const BlockKey keys[] = {key};
  std::vector<SlotId> slots;
  if (!index_->PrepareLoad(keys, &slots).ok()) {
    if (index_->Lookup(key) == LookupResult::kRetry) {
      return UnavailableError("block {} is being written", key.ToString());
    }
    return NotFoundError("block {} is not in the SSD tier", key.ToString());
  }
  out->resize(block_bytes_);
  Result<size_t> n = Read(key, slots[0], *out);
  index_->CompleteLoad(keys).IgnoreError();
  if (!n.ok()) {
    out->clear();
    Remove(keys);
    return n.status();
  }
  out->resize(*n);
  return Status::OK();
}

Status SsdTier::Delete(const BlockKey& key) {
  const BlockKey keys[] = {key};
  switch (index_->Lookup(key)) {
    case LookupResult::kMiss:
      return NotFoundError("block {} is not in the SSD tier", key.ToString());
    case LookupResult::kRetry:
      return FailedPreconditionError("block {} is being written", key.ToString());
    case LookupResult::kHit:
      break;
  }
  if (Remove(keys) == 0) {
    return FailedPreconditionError("block {} is pinned by a reader", key.ToString());
  }
  return Status::OK();
}

std::vector<BlockKey> SsdTier::ResidentKeys() const {
  const BlockManagerState state = index_->DebugState();
  std::vector<BlockKey> keys;
  keys.reserve(state.lru.size() + state.t1.size() + state.t2.size());
  for (const auto* list : {&state.lru, &state.t1, &state.t2}) {
    for (const BlockInfo& b : *list) {
      if (b.ref_count >= 0) keys.push_back(b.key);
    }
  }
  return keys;
}

SsdTierStats SsdTier::stats() const {
  SsdTierStats s;
  s.blocks_written = impl_->blocks_written;
  s.bytes_written = impl_->bytes_written;
  s.blocks_read = impl_->blocks_read;
  s.bytes_read = impl_->bytes_read;
  s.write_failures = impl_->write_failures;
  s.checksum_failures = impl_->checksum_failures;
  s.read_errors = impl_->read_errors;
  s.evictions = impl_->evictions;
  s.restored_blocks = impl_->restored_blocks;
  s.dropped_records = impl_->dropped_records;
  return s;
}

}  // namespace kvstash::store
