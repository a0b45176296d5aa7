#pragma once

// Hybrid-attention decoder-only transformers: the config (a small JSON document or a built-in
// name) and the float32 weights (from a seed, deterministically, or from a safetensors file).
//
// Every layer is RMSNorm -> mixer -> residual, RMSNorm -> SiLU-gated MLP -> residual. The mixer
// is one of:
//   - full attention, sliding-window attention (window W: a query sees itself and the W - 1
//     tokens before it), chunked-local attention (a query sees the tokens of its own chunk of C
//     up to itself): GQA heads, RoPE on queries and keys;
//   - a KV-sharing layer: its own queries over the KV of an earlier attention layer (and that
//     layer's mask); it stores no KV;
//   - a state layer: a gated linear recurrence per head with a fixed-size state
//     (S = sigmoid(g + bias) * S + k v^T, out = S^T q; see kernels::StateScan), standing in for
//     Mamba.
// Value types; thread-compatible.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/common/status.h"

namespace kvstash::engine {

struct LayerConfig {
  enum class Kind : uint8_t { kFull, kSlidingWindow, kChunkedLocal, kKvShare, kState };
  Kind kind = Kind::kFull;
  uint32_t window = 0;      // kSlidingWindow
  uint32_t chunk = 0;       // kChunkedLocal
  int32_t share_from = -1;  // kKvShare: index of an earlier full/sliding/chunked layer
  friend bool operator==(const LayerConfig&, const LayerConfig&) = default;
};

std::string_view LayerKindName(LayerConfig::Kind kind);

struct ModelConfig {
  std::string name;
  uint32_t vocab_size = 256;
  uint32_t hidden = 64;
  uint32_t num_heads = 4;
  uint32_t num_kv_heads = 2;
  uint32_t head_dim = 16;
  uint32_t intermediate = 192;
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
  // Added to a state layer's gate logits: sigmoid(3) ~ 0.95 keeps a state over ~20 tokens.
  float state_gate_bias = 3.0f;
  uint64_t seed = 1;  // weights seed when no weights file is given
  std::vector<LayerConfig> layers;

  // Parses a config document (JSON; see ToJson for the fields). InvalidArgument naming the
  // field on a bad or missing value.
  static Result<ModelConfig> FromJson(std::string_view text);
  // `builtin:NAME` (tiny-full, tiny-swa, tiny-hybrid, tiny-state-hybrid) or a JSON file path.
  // NotFound for an unknown built-in or a missing file.
  static Result<ModelConfig> Load(std::string_view spec);
  static std::vector<std::string> BuiltinNames();

  std::string ToJson() const;
  // InvalidArgument when shapes do not fit (heads not a multiple of KV heads, odd head_dim,
  // a KV-sharing layer pointing at a later layer or a state layer, a zero window...).
  Status Validate() const;

  bool HasStateLayers() const;
  // Floats of one state layer's state: num_heads * head_dim * head_dim.
  size_t StateFloats() const { return size_t{num_heads} * head_dim * head_dim; }
  // Floats of one token's keys and values in one attention layer.
  size_t KvFloatsPerToken() const { return 2 * size_t{num_kv_heads} * head_dim; }
  // Parameters, embeddings and head included.
  size_t NumParameters() const;
};

// Weights, row-major float32. Projections are [in][out]: y = x · W.
struct LayerWeights {
  std::vector<float> attn_norm;    // [hidden]
  std::vector<float> wq;           // [hidden][num_heads * head_dim]   (attention, KV-share, state)
  std::vector<float> wk;           // [hidden][num_kv_heads * head_dim] (attention; state: heads)
  std::vector<float> wv;           // [hidden][num_kv_heads * head_dim] (attention; state: heads)
  std::vector<float> wgate_state;  // [hidden][num_heads] (state layers only)
  std::vector<float> wo;           // [num_heads * head_dim][hidden]
  std::vector<float> mlp_norm;     // [hidden]
  std::vector<float> w_gate;       // [hidden][intermediate]
  std::vector<float> w_up;         // [hidden][intermediate]
  std::vector<float> w_down;       // [intermediate][hidden]
};

struct ModelWeights {
  std::vector<float> embed;  // [vocab][hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [hidden]
  std::vector<float> lm_head;     // [hidden][vocab]

  // Deterministic weights from `seed` (splitmix64 streams per tensor, uniform in
  // +-1/sqrt(fan_in); norms near 1): the same on every machine.
  static ModelWeights FromSeed(const ModelConfig& config, uint64_t seed);
  // Tensors by name from a safetensors file (F32, F16 or BF16): "embed", "final_norm",
  // "lm_head", "layers.N.{attn_norm,wq,wk,wv,wgate_state,wo,mlp_norm,w_gate,w_up,w_down}",
  // shapes as above. InvalidArgument naming the tensor on a missing tensor or a wrong shape.
  static Result<ModelWeights> FromSafetensors(const ModelConfig& config, const std::string& path);
  // Writes the weights as a safetensors file (F32), the inverse of FromSafetensors.
  Status ToSafetensors(const ModelConfig& config, const std::string& path) const;
};

}  // namespace kvstash::engine
