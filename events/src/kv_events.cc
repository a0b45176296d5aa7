#include "kvstash/events/kv_events.h"

#include <msgpack.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string_view>
#include <type_traits>

namespace kvstash::events {
namespace {

// ---- encoding ------------------------------------------------------------------------------

class Packer {
 public:
  Packer() {
    msgpack_sbuffer_init(&buffer_);
    msgpack_packer_init(&packer_, &buffer_, msgpack_sbuffer_write);
  }
  ~Packer() { msgpack_sbuffer_destroy(&buffer_); }
  Packer(const Packer&) = delete;
  Packer& operator=(const Packer&) = delete;

  void Array(size_t n) { msgpack_pack_array(&packer_, n); }
  void Nil() { msgpack_pack_nil(&packer_); }
  void Int(int64_t v) { msgpack_pack_int64(&packer_, v); }
  void Uint(uint64_t v) { msgpack_pack_uint64(&packer_, v); }
  void Double(double v) { msgpack_pack_double(&packer_, v); }
  void Str(std::string_view s) {
    msgpack_pack_str(&packer_, s.size());
    msgpack_pack_str_body(&packer_, s.data(), s.size());
  }
  void Bin(std::string_view s) {
    msgpack_pack_bin(&packer_, s.size());
    msgpack_pack_bin_body(&packer_, s.data(), s.size());
  }
  void Hash(const Hash128& h) {
    if (h.hi == 0) {
      Uint(h.lo);
      return;
    }
    char bytes[16];
    for (int i = 0; i < 8; ++i) {
      bytes[i] = static_cast<char>((h.hi >> (56 - 8 * i)) & 0xff);
      bytes[8 + i] = static_cast<char>((h.lo >> (56 - 8 * i)) & 0xff);
    }
    Bin(std::string_view(bytes, sizeof(bytes)));
  }
  void Hash(const ExternalHash& h) {
    if (const auto* n = std::get_if<uint64_t>(&h)) {
      Uint(*n);
    } else {
      Bin(std::get<std::string>(h));
    }
  }
  void Hashes(const std::vector<ExternalHash>& hashes) {
    Array(hashes.size());
    for (const auto& h : hashes) Hash(h);
  }
  template <typename T>
  void Optional(const std::optional<T>& v) {
    if (!v) {
      Nil();
    } else if constexpr (std::is_same_v<T, std::string>) {
      Str(*v);
    } else if constexpr (std::is_same_v<T, ExternalHash>) {
      Hash(*v);
    } else {
      Int(*v);
    }
  }
  std::string Take() const { return std::string(buffer_.data, buffer_.size); }

 private:
  msgpack_sbuffer buffer_;
  msgpack_packer packer_;
};

void Encode(Packer& p, const BlockStored& e) {
  // Fields after lora_name have defaults (None); msgspec leaves out the trailing ones that hold
  // them.
  size_t n = 8;
  if (e.kv_cache_spec_sliding_window) {
    n = 12;
  } else if (e.kv_cache_spec_kind) {
    n = 11;
  } else if (e.group_idx) {
    n = 10;
  }
  p.Array(n);
  p.Str("BlockStored");
  p.Hashes(e.block_hashes);
  p.Optional(e.parent_block_hash);
  p.Array(e.token_ids.size());
  for (int64_t t : e.token_ids) p.Int(t);
  p.Int(e.block_size);
  p.Optional(e.lora_id);
  p.Optional(e.medium);
  p.Optional(e.lora_name);
  if (n > 8) p.Nil();  // extra_keys
  if (n > 9) p.Optional(e.group_idx);
  if (n > 10) p.Optional(e.kv_cache_spec_kind);
  if (n > 11) p.Optional(e.kv_cache_spec_sliding_window);
}

void Encode(Packer& p, const BlockRemoved& e) {
  p.Array(e.group_idx ? 4 : 3);
  p.Str("BlockRemoved");
  p.Hashes(e.block_hashes);
  p.Optional(e.medium);
  if (e.group_idx) p.Int(*e.group_idx);
}

void Encode(Packer& p, const AllBlocksCleared&) {
  p.Array(1);
  p.Str("AllBlocksCleared");
}

// ---- decoding ------------------------------------------------------------------------------

constexpr size_t kMaxDepth = 16;

// Fails unless `bytes` hold exactly one msgpack object whose containers hold as many objects as
// they declare, nested at most kMaxDepth deep: so that msgpack-c, which allocates a container's
// elements when it reads its header, never allocates for elements the input does not hold.
Status CheckShape(std::span<const std::byte> bytes) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t size = bytes.size();
  size_t pos = 0;
  std::vector<uint64_t> pending = {1};
  auto be = [&](size_t width) -> std::optional<uint64_t> {
    if (size - pos < width) return std::nullopt;
    uint64_t v = 0;
    for (size_t i = 0; i < width; ++i) v = (v << 8) | data[pos + i];
    pos += width;
    return v;
  };
  while (!pending.empty()) {
    if (pending.back() == 0) {
      pending.pop_back();
      continue;
    }
    --pending.back();
    if (pos >= size) return InvalidArgumentError("msgpack ends early, at byte {}", pos);
    const uint8_t b = data[pos++];
    uint64_t skip = 0;      // bytes of payload after the header
    uint64_t children = 0;  // objects a container holds
    bool container = false;
    std::optional<uint64_t> len;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
      // fixint, nil, bool
    } else if (b >= 0x80 && b <= 0x8f) {
      container = true;
      children = 2 * uint64_t{b & 0x0fu};
    } else if (b >= 0x90 && b <= 0x9f) {
      container = true;
      children = b & 0x0fu;
    } else if (b >= 0xa0 && b <= 0xbf) {
      skip = b & 0x1fu;
    } else {
      switch (b) {
        case 0xc4:
        case 0xd9:
          len = be(1);
          break;  // bin8, str8
        case 0xc5:
        case 0xda:
          len = be(2);
          break;  // bin16, str16
        case 0xc6:
        case 0xdb:
          len = be(4);
          break;  // bin32, str32
        case 0xc7:
          len = be(1);
          if (len) *len += 1;
          break;  // ext8 (+ type)
        case 0xc8:
          len = be(2);
          if (len) *len += 1;
          break;
        case 0xc9:
          len = be(4);
          if (len) *len += 1;
          break;
        case 0xca:
          skip = 4;
          break;
        case 0xcb:
          skip = 8;
          break;
        case 0xcc:
        case 0xd0:
          skip = 1;
          break;
        case 0xcd:
        case 0xd1:
          skip = 2;
          break;
        case 0xce:
        case 0xd2:
          skip = 4;
          break;
        case 0xcf:
        case 0xd3:
          skip = 8;
          break;
        case 0xd4:
          skip = 2;
          break;
        case 0xd5:
          skip = 3;
          break;
        case 0xd6:
          skip = 5;
          break;
        case 0xd7:
          skip = 9;
          break;
        case 0xd8:
          skip = 17;
          break;
        case 0xdc:
          container = true;
          len = be(2);
          break;
        case 0xdd:
          container = true;
          len = be(4);
          break;
        case 0xde:
          container = true;
          len = be(2);
          if (len) *len *= 2;
          break;
        case 0xdf:
          container = true;
          len = be(4);
          if (len) *len *= 2;
          break;
        default:
          return InvalidArgumentError("not msgpack: byte 0x{:02x} at {}", b, pos - 1);
      }
      if ((b >= 0xc4 && b <= 0xc9) || (b >= 0xd9 && b <= 0xdf)) {
        if (!len) return InvalidArgumentError("msgpack ends early, at byte {}", pos);
        if (container) {
          children = *len;
        } else {
          skip = *len;
        }
      }
    }
    if (container) {
      if (children > size - pos) {
        return InvalidArgumentError(
            "a msgpack container at byte {} declares {} objects, more "
            "than the {} bytes left",
            pos, children, size - pos);
      }
      if (children > 0) {
        if (pending.size() > kMaxDepth) {
          return InvalidArgumentError("msgpack nested deeper than {}", kMaxDepth);
        }
        pending.push_back(children);
      }
    } else {
      if (skip > size - pos) return InvalidArgumentError("msgpack ends early, at byte {}", pos);
      pos += skip;
    }
  }
  if (pos != size) {
    return InvalidArgumentError("{} bytes after the batch's msgpack object", size - pos);
  }
  return Status::OK();
}

std::string_view AsView(const msgpack_object_str& s) { return {s.ptr, s.size}; }

Result<int64_t> Int(const msgpack_object& o, std::string_view what) {
  if (o.type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
    if (o.via.u64 > static_cast<uint64_t>(INT64_MAX)) {
      return InvalidArgumentError("{}: {} is out of range", what, o.via.u64);
    }
    return static_cast<int64_t>(o.via.u64);
  }
  if (o.type == MSGPACK_OBJECT_NEGATIVE_INTEGER) return o.via.i64;
  return InvalidArgumentError("{} is not an integer", what);
}

Result<std::optional<int64_t>> OptInt(const msgpack_object& o, std::string_view what) {
  if (o.type == MSGPACK_OBJECT_NIL) return std::optional<int64_t>();
  KVSTASH_ASSIGN_OR_RETURN(int64_t v, Int(o, what));
  return std::optional<int64_t>(v);
}

Result<std::optional<std::string>> OptStr(const msgpack_object& o, std::string_view what) {
  if (o.type == MSGPACK_OBJECT_NIL) return std::optional<std::string>();
  if (o.type != MSGPACK_OBJECT_STR) return InvalidArgumentError("{} is not a string", what);
  return std::optional<std::string>(std::string(AsView(o.via.str)));
}

Result<ExternalHash> Hash(const msgpack_object& o, std::string_view what) {
  switch (o.type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
      return ExternalHash(o.via.u64);
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
      return ExternalHash(static_cast<uint64_t>(o.via.i64));
    case MSGPACK_OBJECT_BIN:
      return ExternalHash(std::string(o.via.bin.ptr, o.via.bin.size));
    default:
      return InvalidArgumentError("{} is neither an integer nor bytes", what);
  }
}

Result<std::vector<ExternalHash>> Hashes(const msgpack_object& o, std::string_view what) {
  if (o.type != MSGPACK_OBJECT_ARRAY) return InvalidArgumentError("{} is not an array", what);
  std::vector<ExternalHash> out;
  out.reserve(o.via.array.size);
  for (uint32_t i = 0; i < o.via.array.size; ++i) {
    KVSTASH_ASSIGN_OR_RETURN(ExternalHash h, Hash(o.via.array.ptr[i], what));
    out.push_back(std::move(h));
  }
  return out;
}

// An event's or batch's fields by name, from either layout: `names[i]` is field i.
class Fields {
 public:
  Fields() = default;
  // Array layout: element 0 is the tag when `tagged`.
  static Fields FromArray(const msgpack_object_array& a, bool tagged) {
    Fields f;
    f.array_ = &a;
    f.offset_ = tagged ? 1 : 0;
    return f;
  }
  static Fields FromMap(const msgpack_object_map& m) {
    Fields f;
    f.map_ = &m;
    return f;
  }
  // Field `index` named `name`, or nullptr when absent (left out as a default).
  const msgpack_object* Get(size_t index, std::string_view name) const {
    if (array_ == nullptr && map_ == nullptr) return nullptr;
    if (array_ != nullptr) {
      const size_t i = index + offset_;
      return i < array_->size ? &array_->ptr[i] : nullptr;
    }
    for (uint32_t i = 0; i < map_->size; ++i) {
      const msgpack_object& k = map_->ptr[i].key;
      if (k.type == MSGPACK_OBJECT_STR && AsView(k.via.str) == name) return &map_->ptr[i].val;
    }
    return nullptr;
  }

 private:
  const msgpack_object_array* array_ = nullptr;
  const msgpack_object_map* map_ = nullptr;
  size_t offset_ = 0;
};

const msgpack_object kNil = {MSGPACK_OBJECT_NIL, {}};

Result<KvEvent> DecodeEvent(const msgpack_object& o) {
  std::string_view tag;
  Fields fields;
  if (o.type == MSGPACK_OBJECT_ARRAY) {
    fields = Fields::FromArray(o.via.array, true);
    if (o.via.array.size == 0 || o.via.array.ptr[0].type != MSGPACK_OBJECT_STR) {
      return InvalidArgumentError("an event array does not start with its tag");
    }
    tag = AsView(o.via.array.ptr[0].via.str);
  } else if (o.type == MSGPACK_OBJECT_MAP) {
    fields = Fields::FromMap(o.via.map);
    const msgpack_object* t = fields.Get(0, "type");
    if (t == nullptr || t->type != MSGPACK_OBJECT_STR) {
      return InvalidArgumentError("an event map has no \"type\" tag");
    }
    tag = AsView(t->via.str);
  } else {
    return InvalidArgumentError("an event is neither an array nor a map");
  }
  // A required field missing is an error; an optional one is its default.
  auto required = [&](size_t i, std::string_view name) -> Result<const msgpack_object*> {
    const msgpack_object* v = fields.Get(i, name);
    if (v == nullptr) return InvalidArgumentError("{} has no {}", tag, name);
    return v;
  };
  auto optional = [&](size_t i, std::string_view name) -> const msgpack_object& {
    const msgpack_object* v = fields.Get(i, name);
    return v == nullptr ? kNil : *v;
  };
  if (tag == "BlockStored") {
    BlockStored e;
    KVSTASH_ASSIGN_OR_RETURN(const msgpack_object* hashes, required(0, "block_hashes"));
    KVSTASH_ASSIGN_OR_RETURN(e.block_hashes, Hashes(*hashes, "BlockStored.block_hashes"));
    KVSTASH_ASSIGN_OR_RETURN(const msgpack_object* parent, required(1, "parent_block_hash"));
    if (parent->type != MSGPACK_OBJECT_NIL) {
      KVSTASH_ASSIGN_OR_RETURN(e.parent_block_hash, Hash(*parent, "BlockStored.parent_block_hash"));
    }
    KVSTASH_ASSIGN_OR_RETURN(const msgpack_object* tokens, required(2, "token_ids"));
    if (tokens->type != MSGPACK_OBJECT_ARRAY) {
      return InvalidArgumentError("BlockStored.token_ids is not an array");
    }
    e.token_ids.reserve(tokens->via.array.size);
    for (uint32_t i = 0; i < tokens->via.array.size; ++i) {
      KVSTASH_ASSIGN_OR_RETURN(int64_t t, Int(tokens->via.array.ptr[i], "BlockStored.token_ids"));
      e.token_ids.push_back(t);
    }
    KVSTASH_ASSIGN_OR_RETURN(const msgpack_object* size, required(3, "block_size"));
    KVSTASH_ASSIGN_OR_RETURN(e.block_size, Int(*size, "BlockStored.block_size"));
    KVSTASH_ASSIGN_OR_RETURN(const msgpack_object* lora, required(4, "lora_id"));
    KVSTASH_ASSIGN_OR_RETURN(e.lora_id, OptInt(*lora, "BlockStored.lora_id"));
    KVSTASH_ASSIGN_OR_RETURN(const msgpack_object* medium, required(5, "medium"));
    KVSTASH_ASSIGN_OR_RETURN(e.medium, OptStr(*medium, "BlockStored.medium"));
    KVSTASH_ASSIGN_OR_RETURN(const msgpack_object* lora_name, required(6, "lora_name"));
    KVSTASH_ASSIGN_OR_RETURN(e.lora_name, OptStr(*lora_name, "BlockStored.lora_name"));
    // 7: extra_keys, any shape, not kept.
    KVSTASH_ASSIGN_OR_RETURN(e.group_idx,
                             OptInt(optional(8, "group_idx"), "BlockStored.group_idx"));
    KVSTASH_ASSIGN_OR_RETURN(e.kv_cache_spec_kind, OptStr(optional(9, "kv_cache_spec_kind"),
                                                          "BlockStored.kv_cache_spec_kind"));
    KVSTASH_ASSIGN_OR_RETURN(e.kv_cache_spec_sliding_window,
                             OptInt(optional(10, "kv_cache_spec_sliding_window"),
                                    "BlockStored.kv_cache_spec_sliding_window"));
    return KvEvent(std::move(e));
  }
  if (tag == "BlockRemoved") {
    BlockRemoved e;
    KVSTASH_ASSIGN_OR_RETURN(const msgpack_object* hashes, required(0, "block_hashes"));
    KVSTASH_ASSIGN_OR_RETURN(e.block_hashes, Hashes(*hashes, "BlockRemoved.block_hashes"));
    KVSTASH_ASSIGN_OR_RETURN(const msgpack_object* medium, required(1, "medium"));
    KVSTASH_ASSIGN_OR_RETURN(e.medium, OptStr(*medium, "BlockRemoved.medium"));
    KVSTASH_ASSIGN_OR_RETURN(e.group_idx,
                             OptInt(optional(2, "group_idx"), "BlockRemoved.group_idx"));
    return KvEvent(std::move(e));
  }
  if (tag == "AllBlocksCleared") return KvEvent(AllBlocksCleared{});
  return InvalidArgumentError("unknown event tag \"{}\"", tag);
}

struct Unpacked {
  Unpacked() { msgpack_unpacked_init(&u); }
  ~Unpacked() { msgpack_unpacked_destroy(&u); }
  Unpacked(const Unpacked&) = delete;
  Unpacked& operator=(const Unpacked&) = delete;
  msgpack_unpacked u;
};

}  // namespace

ExternalHash ExternalHashOf(const Hash128& hash) {
  if (hash.hi == 0) return hash.lo;
  std::string bytes(16, '\0');
  for (int i = 0; i < 8; ++i) {
    bytes[i] = static_cast<char>((hash.hi >> (56 - 8 * i)) & 0xff);
    bytes[8 + i] = static_cast<char>((hash.lo >> (56 - 8 * i)) & 0xff);
  }
  return bytes;
}

std::string EncodeRuns(double ts, std::span<const BlockRun> runs) {
  Packer p;
  p.Array(2);
  p.Double(ts);
  p.Array(runs.size());
  for (const BlockRun& run : runs) {
    switch (run.kind) {
      case BlockRun::Kind::kAllCleared:
        Encode(p, AllBlocksCleared{});
        continue;
      case BlockRun::Kind::kStored:
        // As Encode(BlockStored) with group_idx set and the spec fields None.
        p.Array(10);
        p.Str("BlockStored");
        p.Array(run.hashes.size());
        for (const Hash128& h : run.hashes) p.Hash(h);
        if (run.parent) {
          p.Hash(*run.parent);  // parent_block_hash
        } else {
          p.Nil();
        }
        p.Array(0);  // token_ids
        p.Int(run.block_size);
        p.Nil();  // lora_id
        p.Str(run.medium);
        p.Nil();  // lora_name
        p.Nil();  // extra_keys
        p.Int(run.group);
        continue;
      case BlockRun::Kind::kRemoved:
        p.Array(4);
        p.Str("BlockRemoved");
        p.Array(run.hashes.size());
        for (const Hash128& h : run.hashes) p.Hash(h);
        p.Str(run.medium);
        p.Int(run.group);
        continue;
    }
  }
  return p.Take();
}

std::string EncodeBatch(const KvEventBatch& batch) {
  Packer p;
  p.Array(batch.data_parallel_rank ? 3 : 2);
  p.Double(batch.ts);
  p.Array(batch.events.size());
  for (const KvEvent& e : batch.events) {
    std::visit([&](const auto& event) { Encode(p, event); }, e);
  }
  if (batch.data_parallel_rank) p.Int(*batch.data_parallel_rank);
  return p.Take();
}

Result<KvEventBatch> DecodeBatch(std::span<const std::byte> bytes, size_t max_bytes) {
  if (bytes.size() > max_bytes) {
    return InvalidArgumentError("an event batch of {} bytes is over the limit of {}", bytes.size(),
                                max_bytes);
  }
  KVSTASH_RETURN_IF_ERROR(CheckShape(bytes));
  Unpacked unpacked;
  size_t offset = 0;
  const msgpack_unpack_return r = msgpack_unpack_next(
      &unpacked.u, reinterpret_cast<const char*>(bytes.data()), bytes.size(), &offset);
  if (r != MSGPACK_UNPACK_SUCCESS || offset != bytes.size()) {
    return InvalidArgumentError("msgpack-c could not read the batch ({})", static_cast<int>(r));
  }
  const msgpack_object& root = unpacked.u.data;
  Fields fields;
  if (root.type == MSGPACK_OBJECT_ARRAY) {
    fields = Fields::FromArray(root.via.array, false);
  } else if (root.type == MSGPACK_OBJECT_MAP) {
    fields = Fields::FromMap(root.via.map);
  } else {
    return InvalidArgumentError("an event batch is neither an array nor a map");
  }
  KvEventBatch batch;
  const msgpack_object* ts = fields.Get(0, "ts");
  if (ts == nullptr) return InvalidArgumentError("an event batch has no ts");
  if (ts->type == MSGPACK_OBJECT_FLOAT64 || ts->type == MSGPACK_OBJECT_FLOAT32) {
    batch.ts = ts->via.f64;
  } else {
    KVSTASH_ASSIGN_OR_RETURN(int64_t whole, Int(*ts, "the batch's ts"));
    batch.ts = static_cast<double>(whole);
  }
  const msgpack_object* events = fields.Get(1, "events");
  if (events == nullptr || events->type != MSGPACK_OBJECT_ARRAY) {
    return InvalidArgumentError("an event batch has no events array");
  }
  batch.events.reserve(events->via.array.size);
  for (uint32_t i = 0; i < events->via.array.size; ++i) {
    KVSTASH_ASSIGN_OR_RETURN(KvEvent e, DecodeEvent(events->via.array.ptr[i]));
    batch.events.push_back(std::move(e));
  }
  const msgpack_object* rank = fields.Get(2, "data_parallel_rank");
  if (rank != nullptr) {
    KVSTASH_ASSIGN_OR_RETURN(batch.data_parallel_rank,
                             OptInt(*rank, "the batch's data_parallel_rank"));
  }
  return batch;
}

namespace {

std::string HashText(const ExternalHash& h) {
  if (const auto* n = std::get_if<uint64_t>(&h)) return std::to_string(*n);
  std::string out = "0x";
  for (unsigned char c : std::get<std::string>(h)) out += fmt::format("{:02x}", c);
  return out;
}

std::string HashesText(const std::vector<ExternalHash>& hashes) {
  std::string out = "[";
  for (size_t i = 0; i < hashes.size(); ++i) out += (i ? ", " : "") + HashText(hashes[i]);
  return out + "]";
}

template <typename T>
std::string OptText(const std::optional<T>& v) {
  if (!v) return "None";
  if constexpr (std::is_same_v<T, std::string>) {
    return *v;
  } else {
    return std::to_string(*v);
  }
}

}  // namespace

std::string DebugString(const KvEvent& event) {
  if (const auto* s = std::get_if<BlockStored>(&event)) {
    std::string tokens;
    for (int64_t t : s->token_ids) tokens += (tokens.empty() ? "" : ", ") + std::to_string(t);
    return fmt::format(
        "BlockStored(hashes={}, parent={}, tokens=[{}], block_size={}, medium={}, group={}, "
        "kind={}, window={})",
        HashesText(s->block_hashes),
        s->parent_block_hash ? HashText(*s->parent_block_hash) : std::string("None"), tokens,
        s->block_size, OptText(s->medium), OptText(s->group_idx), OptText(s->kv_cache_spec_kind),
        OptText(s->kv_cache_spec_sliding_window));
  }
  if (const auto* r = std::get_if<BlockRemoved>(&event)) {
    return fmt::format("BlockRemoved(hashes={}, medium={}, group={})", HashesText(r->block_hashes),
                       OptText(r->medium), OptText(r->group_idx));
  }
  return "AllBlocksCleared()";
}

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string EncodeSequence(int64_t sequence) {
  std::string out(8, '\0');
  const auto v = static_cast<uint64_t>(sequence);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (56 - 8 * i)) & 0xff);
  return out;
}

Result<int64_t> DecodeSequence(std::span<const std::byte> bytes) {
  if (bytes.size() != 8) {
    return InvalidArgumentError("a sequence number is 8 bytes, not {}", bytes.size());
  }
  uint64_t v = 0;
  for (std::byte b : bytes) v = (v << 8) | std::to_integer<uint64_t>(b);
  return static_cast<int64_t>(v);
}

}  // namespace kvstash::events
