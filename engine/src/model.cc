#include "kvstash/engine/model.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "kvstash/common/hash.h"
#include "nlohmann/json.hpp"

namespace kvstash::engine {
namespace {

using LayerKind = LayerConfig::Kind;
using nlohmann::json;

struct KindName {
  LayerKind kind;
  std::string_view name;
};
constexpr KindName kKindNames[] = {{LayerKind::kFull, "full"},
                                   {LayerKind::kSlidingWindow, "sliding_window"},
                                   {LayerKind::kChunkedLocal, "chunked_local"},
                                   {LayerKind::kKvShare, "kv_share"},
                                   {LayerKind::kState, "state"}};

LayerConfig Full() { return {LayerKind::kFull, 0, 0, -1}; }
LayerConfig Swa(uint32_t w) { return {LayerKind::kSlidingWindow, w, 0, -1}; }
LayerConfig Chunked(uint32_t c) { return {LayerKind::kChunkedLocal, 0, c, -1}; }
LayerConfig Share(int32_t from) { return {LayerKind::kKvShare, 0, 0, from}; }
LayerConfig State() { return {LayerKind::kState, 0, 0, -1}; }

ModelConfig Tiny(std::string name, std::vector<LayerConfig> layers) {
  ModelConfig c;
  c.name = std::move(name);
  c.layers = std::move(layers);
  return c;
}

// The built-ins share one shape (hidden 64, 4 query heads and 2 KV heads of 16, vocab 256) so
// that a state (4 * 16 * 16 floats) fills a page of 16 tokens of one attention layer's KV.
std::vector<ModelConfig> Builtins() {
  return {
      Tiny("tiny-full", {Full(), Full(), Full(), Full()}),
      Tiny("tiny-swa", {Swa(32), Swa(32), Swa(32), Swa(32)}),
      Tiny("tiny-hybrid", {Full(), Swa(32), Chunked(64), Full(), Swa(32), Share(1)}),
      Tiny("tiny-state-hybrid", {Full(), State(), Full(), State(), Full(), State(), Full()}),
  };
}

Result<uint32_t> GetU32(const json& doc, const char* field, uint32_t fallback, bool required) {
  auto it = doc.find(field);
  if (it == doc.end()) {
    if (required) return InvalidArgumentError("model config: missing field '{}'", field);
    return fallback;
  }
  if (!it->is_number_unsigned() || it->get<uint64_t>() > UINT32_MAX) {
    return InvalidArgumentError("model config: '{}' must be an unsigned integer, not {}", field,
                                it->dump());
  }
  return it->get<uint32_t>();
}

// Uniform floats in [-scale, scale) from a splitmix64 stream: bit-identical everywhere.
void FillUniform(std::vector<float>& v, size_t n, uint64_t seed, uint64_t stream, float scale,
                 float center = 0.0f) {
  v.resize(n);
  uint64_t state = Mix64(seed ^ Mix64(stream + 0x9e3779b97f4a7c15ULL));
  for (size_t i = 0; i < n; ++i) {
    state += 0x9e3779b97f4a7c15ULL;
    const uint64_t bits = Mix64(state) >> 40;                         // 24 bits: exact in float
    const float u = static_cast<float>(bits) * (1.0f / 16777216.0f);  // [0, 1)
    v[i] = center + scale * (2.0f * u - 1.0f);
  }
}

struct TensorSpec {
  std::string name;
  std::vector<float>* data;
  std::vector<size_t> shape;
};

std::vector<TensorSpec> TensorsOf(const ModelConfig& c, ModelWeights& w) {
  const size_t h = c.hidden, q = size_t{c.num_heads} * c.head_dim,
               kv = size_t{c.num_kv_heads} * c.head_dim, ff = c.intermediate;
  std::vector<TensorSpec> out;
  out.push_back({"embed", &w.embed, {c.vocab_size, h}});
  w.layers.resize(c.layers.size());
  for (size_t i = 0; i < c.layers.size(); ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    LayerWeights& l = w.layers[i];
    const LayerKind kind = c.layers[i].kind;
    out.push_back({p + "attn_norm", &l.attn_norm, {h}});
    out.push_back({p + "wq", &l.wq, {h, q}});
    if (kind == LayerKind::kState) {
      out.push_back({p + "wk", &l.wk, {h, q}});
      out.push_back({p + "wv", &l.wv, {h, q}});
      out.push_back({p + "wgate_state", &l.wgate_state, {h, c.num_heads}});
    } else if (kind != LayerKind::kKvShare) {
      out.push_back({p + "wk", &l.wk, {h, kv}});
      out.push_back({p + "wv", &l.wv, {h, kv}});
    }
    out.push_back({p + "wo", &l.wo, {q, h}});
    out.push_back({p + "mlp_norm", &l.mlp_norm, {h}});
    out.push_back({p + "w_gate", &l.w_gate, {h, ff}});
    out.push_back({p + "w_up", &l.w_up, {h, ff}});
    out.push_back({p + "w_down", &l.w_down, {ff, h}});
  }
  out.push_back({"final_norm", &w.final_norm, {h}});
  out.push_back({"lm_head", &w.lm_head, {h, c.vocab_size}});
  return out;
}

size_t Elements(const std::vector<size_t>& shape) {
  size_t n = 1;
  for (size_t d : shape) n *= d;
  return n;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(mant | 0x400), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

}  // namespace

std::string_view LayerKindName(LayerKind kind) {
  for (const KindName& k : kKindNames) {
    if (k.kind == kind) return k.name;
  }
  return "unknown";
}

std::vector<std::string> ModelConfig::BuiltinNames() {
  std::vector<std::string> names;
  for (const ModelConfig& c : Builtins()) names.push_back(c.name);
  return names;
}

Result<ModelConfig> ModelConfig::FromJson(std::string_view text) {
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  if (doc.is_discarded() || !doc.is_object()) {
    return InvalidArgumentError("model config: not a JSON object");
  }
  ModelConfig c;
  if (auto it = doc.find("name"); it != doc.end() && it->is_string()) c.name = *it;
  KVSTASH_ASSIGN_OR_RETURN(c.vocab_size, GetU32(doc, "vocab_size", c.vocab_size, false));
  KVSTASH_ASSIGN_OR_RETURN(c.hidden, GetU32(doc, "hidden", c.hidden, false));
  KVSTASH_ASSIGN_OR_RETURN(c.num_heads, GetU32(doc, "num_heads", c.num_heads, false));
  KVSTASH_ASSIGN_OR_RETURN(c.num_kv_heads, GetU32(doc, "num_kv_heads", c.num_kv_heads, false));
  KVSTASH_ASSIGN_OR_RETURN(c.head_dim, GetU32(doc, "head_dim", c.head_dim, false));
  KVSTASH_ASSIGN_OR_RETURN(c.intermediate, GetU32(doc, "intermediate", c.intermediate, false));
  for (auto [field, value] :
       {std::pair{"rope_theta", &c.rope_theta}, std::pair{"rms_eps", &c.rms_eps},
        std::pair{"state_gate_bias", &c.state_gate_bias}}) {
    if (auto it = doc.find(field); it != doc.end()) {
      if (!it->is_number()) {
        return InvalidArgumentError("model config: '{}' must be a number", field);
      }
      *value = it->get<float>();
    }
  }
  if (auto it = doc.find("seed"); it != doc.end()) {
    if (!it->is_number_unsigned()) {
      return InvalidArgumentError("model config: 'seed' must be an unsigned integer");
    }
    c.seed = it->get<uint64_t>();
  }
  auto layers = doc.find("layers");
  if (layers == doc.end() || !layers->is_array() || layers->empty()) {
    return InvalidArgumentError("model config: 'layers' must be a non-empty array");
  }
  for (size_t i = 0; i < layers->size(); ++i) {
    const json& l = (*layers)[i];
    if (!l.is_object() || !l.contains("kind") || !l["kind"].is_string()) {
      return InvalidArgumentError("model config: layers[{}] needs a string 'kind'", i);
    }
    const std::string kind = l["kind"];
    LayerConfig layer;
    bool known = false;
    for (const KindName& k : kKindNames) {
      if (k.name == kind) {
        layer.kind = k.kind;
        known = true;
      }
    }
    if (!known) {
      return InvalidArgumentError(
          "model config: layers[{}] kind '{}' is not one of full, sliding_window, "
          "chunked_local, kv_share, state",
          i, kind);
    }
    KVSTASH_ASSIGN_OR_RETURN(layer.window,
                             GetU32(l, "window", 0, layer.kind == LayerKind::kSlidingWindow));
    KVSTASH_ASSIGN_OR_RETURN(layer.chunk,
                             GetU32(l, "chunk", 0, layer.kind == LayerKind::kChunkedLocal));
    if (layer.kind == LayerKind::kKvShare) {
      auto from = l.find("share_from");
      if (from == l.end() || !from->is_number_integer()) {
        return InvalidArgumentError("model config: layers[{}] (kv_share) needs 'share_from'", i);
      }
      layer.share_from = from->get<int32_t>();
    }
    c.layers.push_back(layer);
  }
  KVSTASH_RETURN_IF_ERROR(c.Validate());
  return c;
}

Result<ModelConfig> ModelConfig::Load(std::string_view spec) {
  constexpr std::string_view kBuiltin = "builtin:";
  if (spec.starts_with(kBuiltin)) {
    const std::string_view name = spec.substr(kBuiltin.size());
    for (ModelConfig& c : Builtins()) {
      if (c.name == name) return c;
    }
    return NotFoundError(
        "no built-in model '{}' (built-ins: tiny-full, tiny-swa, tiny-hybrid, "
        "tiny-state-hybrid)",
        name);
  }
  std::ifstream in{std::string(spec)};
  if (!in) return NotFoundError("model config file '{}' cannot be read", spec);
  std::stringstream text;
  text << in.rdbuf();
  auto config = FromJson(text.str());
  if (!config.ok()) return InvalidArgumentError("{}: {}", spec, config.status().message());
  return config;
}

std::string ModelConfig::ToJson() const {
  json doc = {{"name", name},
              {"vocab_size", vocab_size},
              {"hidden", hidden},
              {"num_heads", num_heads},
              {"num_kv_heads", num_kv_heads},
              {"head_dim", head_dim},
              {"intermediate", intermediate},
              {"rope_theta", rope_theta},
              {"rms_eps", rms_eps},
              {"state_gate_bias", state_gate_bias},
              {"seed", seed}};
  json arr = json::array();
  for (const LayerConfig& l : layers) {
    json j = {{"kind", std::string(LayerKindName(l.kind))}};
    if (l.kind == LayerKind::kSlidingWindow) j["window"] = l.window;
    if (l.kind == LayerKind::kChunkedLocal) j["chunk"] = l.chunk;
    if (l.kind == LayerKind::kKvShare) j["share_from"] = l.share_from;
    arr.push_back(j);
  }
  doc["layers"] = arr;
  return doc.dump(2);
}

Status ModelConfig::Validate() const {
  if (vocab_size == 0 || hidden == 0 || num_heads == 0 || num_kv_heads == 0 || head_dim == 0 ||
      intermediate == 0) {
    return InvalidArgumentError("model config: every dimension must be positive");
  }
  if (num_heads % num_kv_heads != 0) {
    return InvalidArgumentError("model config: num_heads {} is not a multiple of num_kv_heads {}",
                                num_heads, num_kv_heads);
  }
  if (head_dim % 2 != 0 || head_dim > 256) {
    return InvalidArgumentError("model config: head_dim {} must be even and at most 256", head_dim);
  }
  if (!(rope_theta > 0) || !(rms_eps > 0)) {
    return InvalidArgumentError("model config: rope_theta and rms_eps must be positive");
  }
  if (layers.empty()) return InvalidArgumentError("model config: no layers");
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerConfig& l = layers[i];
    if (l.kind == LayerKind::kSlidingWindow && l.window == 0) {
      return InvalidArgumentError("model config: layers[{}] window must be positive", i);
    }
    if (l.kind == LayerKind::kChunkedLocal && l.chunk == 0) {
      return InvalidArgumentError("model config: layers[{}] chunk must be positive", i);
    }
    if (l.kind == LayerKind::kKvShare) {
      if (l.share_from < 0 || static_cast<size_t>(l.share_from) >= i) {
        return InvalidArgumentError(
            "model config: layers[{}] share_from {} must name an earlier layer", i, l.share_from);
      }
      const LayerKind target = layers[l.share_from].kind;
      if (target == LayerKind::kKvShare || target == LayerKind::kState) {
        return InvalidArgumentError(
            "model config: layers[{}] shares layer {}, which stores no attention KV", i,
            l.share_from);
      }
    }
  }
  return Status::OK();
}

bool ModelConfig::HasStateLayers() const {
  for (const LayerConfig& l : layers) {
    if (l.kind == LayerKind::kState) return true;
  }
  return false;
}

size_t ModelConfig::NumParameters() const {
  ModelWeights w;
  size_t n = 0;
  for (const TensorSpec& t : TensorsOf(*this, w)) n += Elements(t.shape);
  return n;
}

ModelWeights ModelWeights::FromSeed(const ModelConfig& config, uint64_t seed) {
  ModelWeights w;
  uint64_t stream = 0;
  for (const TensorSpec& t : TensorsOf(config, w)) {
    ++stream;
    const size_t n = Elements(t.shape);
    if (t.shape.size() == 1) {
      FillUniform(*t.data, n, seed, stream, 0.1f, 1.0f);  // norm weights near 1
    } else if (t.name == "embed") {
      FillUniform(*t.data, n, seed, stream, 1.0f);
    } else {
      FillUniform(*t.data, n, seed, stream, 1.0f / std::sqrt(static_cast<float>(t.shape[0])));
    }
  }
  return w;
}

Result<ModelWeights> ModelWeights::FromSafetensors(const ModelConfig& config,
                                                   const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError("weights file '{}' cannot be read", path);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  if (!in || header_len > (uint64_t{100} << 20)) {
    return InvalidArgumentError("{}: not a safetensors file (header length)", path);
  }
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  if (!in) return InvalidArgumentError("{}: truncated header", path);
  json doc = json::parse(header, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) {
    return InvalidArgumentError("{}: header is not a JSON object", path);
  }
  const std::streamoff data_start = static_cast<std::streamoff>(8 + header_len);
  in.seekg(0, std::ios::end);
  const uint64_t data_len = static_cast<uint64_t>(in.tellg() - data_start);
  ModelWeights w;
  for (const TensorSpec& t : TensorsOf(config, w)) {
    auto it = doc.find(t.name);
    if (it == doc.end()) return InvalidArgumentError("{}: tensor '{}' is missing", path, t.name);
    const json& e = *it;
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") ||
        !e.contains("data_offsets")) {
      return InvalidArgumentError("{}: tensor '{}' has no dtype/shape/data_offsets", path, t.name);
    }
    // The header is the file's, not ours: every type is checked before it is read, so a
    // malformed file is an error, never an exception.
    auto sizes = [](const json& v) {
      return v.is_array() &&
             std::all_of(v.begin(), v.end(), [](const json& x) { return x.is_number_unsigned(); });
    };
    if (!sizes(e["shape"]) || !sizes(e["data_offsets"]) || !e["dtype"].is_string()) {
      return InvalidArgumentError(
          "{}: tensor '{}': shape and data_offsets must be lists of sizes, dtype a string", path,
          t.name);
    }
    std::vector<size_t> shape = e["shape"].get<std::vector<size_t>>();
    if (shape != t.shape) {
      return InvalidArgumentError("{}: tensor '{}' has shape {}, the config needs {}", path, t.name,
                                  e["shape"].dump(), json(t.shape).dump());
    }
    const std::string dtype = e["dtype"];
    const size_t width = dtype == "F32" ? 4 : (dtype == "F16" || dtype == "BF16") ? 2 : 0;
    if (width == 0) {
      return InvalidArgumentError("{}: tensor '{}' has dtype {}; F32, F16 or BF16 expected", path,
                                  t.name, dtype);
    }
    const auto offsets = e["data_offsets"].get<std::vector<uint64_t>>();
    const size_t n = Elements(shape);
    if (offsets.size() != 2 || offsets[1] < offsets[0] || offsets[1] - offsets[0] != n * width ||
        offsets[1] > data_len) {
      return InvalidArgumentError("{}: tensor '{}' data_offsets do not fit its shape", path,
                                  t.name);
    }
    std::vector<char> raw(n * width);
    in.seekg(data_start + static_cast<std::streamoff>(offsets[0]));
    in.read(raw.data(), static_cast<std::streamsize>(raw.size()));
    if (!in) return InvalidArgumentError("{}: tensor '{}' is truncated", path, t.name);
    t.data->resize(n);
    for (size_t i = 0; i < n; ++i) {
      if (width == 4) {
        std::memcpy(&(*t.data)[i], raw.data() + 4 * i, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, raw.data() + 2 * i, 2);
        (*t.data)[i] = dtype == "BF16" ? std::bit_cast<float>(uint32_t{h} << 16) : HalfToFloat(h);
      }
    }
  }
  return w;
}

Status ModelWeights::ToSafetensors(const ModelConfig& config, const std::string& path) const {
  ModelWeights copy = *this;
  json header = json::object();
  uint64_t offset = 0;
  const std::vector<TensorSpec> tensors = TensorsOf(config, copy);
  for (const TensorSpec& t : tensors) {
    const uint64_t bytes = Elements(t.shape) * 4;
    if (t.data->size() != Elements(t.shape)) {
      return InvalidArgumentError("tensor '{}' holds {} floats, its shape needs {}", t.name,
                                  t.data->size(), Elements(t.shape));
    }
    header[t.name] = {
        {"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return FromErrno(errno, "open " + path);
  const uint64_t len = text.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const TensorSpec& t : tensors) {
    out.write(reinterpret_cast<const char*>(t.data->data()),
              static_cast<std::streamsize>(t.data->size() * 4));
  }
  if (!out.flush()) return FromErrno(errno, "write " + path);
  return Status::OK();
}

}  // namespace kvstash::engine
