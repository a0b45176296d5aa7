// The engine's forward pass against a dense reference written here: no paging, no cache, plain
// loops in double. Every built-in model, prompts crossing block and window boundaries, run in
// one step and in uneven chunks, with packed pages; plus the config and weights formats.

#include "kvstash/engine/model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kvstash/common/hash.h"
#include "kvstash/engine/kv_cache_manager.h"
#include "kvstash/engine/model_runner.h"

namespace kvstash::engine {
namespace {

using Kind = LayerConfig::Kind;
using Mat = std::vector<double>;

// ---- The dense reference ----------------------------------------------------------------

void RefRmsNorm(const Mat& x, const std::vector<float>& w, Mat& y, size_t n, size_t d, double eps) {
  y.assign(n * d, 0);
  for (size_t i = 0; i < n; ++i) {
    double ss = 0;
    for (size_t j = 0; j < d; ++j) ss += x[i * d + j] * x[i * d + j];
    const double r = 1.0 / std::sqrt(ss / d + eps);
    for (size_t j = 0; j < d; ++j) y[i * d + j] = x[i * d + j] * r * w[j];
  }
}

Mat RefMatMul(const Mat& x, const std::vector<float>& w, size_t n, size_t in, size_t out) {
  Mat y(n * out, 0);
  for (size_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < in; ++k) {
      for (size_t j = 0; j < out; ++j) y[i * out + j] += x[i * in + k] * w[k * out + j];
    }
  }
  return y;
}

void RefRope(Mat& x, size_t n, size_t heads, size_t hd, double theta) {
  const size_t half = hd / 2;
  for (size_t p = 0; p < n; ++p) {
    for (size_t h = 0; h < heads; ++h) {
      for (size_t j = 0; j < half; ++j) {
        const double angle = p * std::pow(theta, -2.0 * j / hd);
        double& a = x[(p * heads + h) * hd + j];
        double& b = x[(p * heads + h) * hd + j + half];
        const double a0 = a, b0 = b;
        a = a0 * std::cos(angle) - b0 * std::sin(angle);
        b = a0 * std::sin(angle) + b0 * std::cos(angle);
      }
    }
  }
}

size_t FirstKey(const LayerConfig& l, size_t p) {
  if (l.kind == Kind::kSlidingWindow) return p + 1 >= l.window ? p + 1 - l.window : 0;
  if (l.kind == Kind::kChunkedLocal) return p / l.chunk * l.chunk;
  return 0;
}

// Logits of every position of `tokens`, [n][vocab].
Mat DenseReference(const ModelConfig& c, const ModelWeights& w,
                   const std::vector<uint32_t>& tokens) {
  const size_t n = tokens.size(), d = c.hidden, hd = c.head_dim, heads = c.num_heads,
               kvh = c.num_kv_heads, qd = heads * hd, kvd = kvh * hd;
  Mat x(n * d);
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < d; ++j) x[i * d + j] = w.embed[tokens[i] * d + j];
  }
  std::vector<Mat> keys(c.layers.size()), values(c.layers.size());
  Mat h;
  for (size_t l = 0; l < c.layers.size(); ++l) {
    const LayerConfig& layer = c.layers[l];
    const LayerWeights& lw = w.layers[l];
    RefRmsNorm(x, lw.attn_norm, h, n, d, c.rms_eps);
    Mat q = RefMatMul(h, lw.wq, n, d, qd);
    Mat mixed(n * qd, 0);
    if (layer.kind == Kind::kState) {
      Mat k = RefMatMul(h, lw.wk, n, d, qd), v = RefMatMul(h, lw.wv, n, d, qd);
      Mat g = RefMatMul(h, lw.wgate_state, n, d, heads);
      Mat s(heads * hd * hd, 0);
      for (size_t p = 0; p < n; ++p) {
        for (size_t hh = 0; hh < heads; ++hh) {
          const double gate = 1.0 / (1.0 + std::exp(-(g[p * heads + hh] + c.state_gate_bias)));
          double* S = &s[hh * hd * hd];
          for (size_t a = 0; a < hd; ++a) {
            for (size_t b = 0; b < hd; ++b) {
              S[a * hd + b] =
                  gate * S[a * hd + b] + k[p * qd + hh * hd + a] * v[p * qd + hh * hd + b];
            }
          }
          for (size_t b = 0; b < hd; ++b) {
            double o = 0;
            for (size_t a = 0; a < hd; ++a) o += S[a * hd + b] * q[p * qd + hh * hd + a];
            mixed[p * qd + hh * hd + b] = o;
          }
        }
      }
    } else {
      size_t target = l;
      if (layer.kind == Kind::kKvShare) {
        target = static_cast<size_t>(layer.share_from);
      } else {
        keys[l] = RefMatMul(h, lw.wk, n, d, kvd);
        values[l] = RefMatMul(h, lw.wv, n, d, kvd);
        RefRope(keys[l], n, kvh, hd, c.rope_theta);
      }
      RefRope(q, n, heads, hd, c.rope_theta);
      const LayerConfig& mask = c.layers[target];
      const Mat& K = keys[target];
      const Mat& V = values[target];
      const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
      for (size_t p = 0; p < n; ++p) {
        for (size_t hh = 0; hh < heads; ++hh) {
          const size_t kh = hh / (heads / kvh);
          const size_t first = FirstKey(mask, p);
          std::vector<double> score(p + 1 - first);
          double mx = -1e300;
          for (size_t t = first; t <= p; ++t) {
            double dot = 0;
            for (size_t j = 0; j < hd; ++j) {
              dot += q[p * qd + hh * hd + j] * K[t * kvd + kh * hd + j];
            }
            score[t - first] = dot * scale;
            mx = std::max(mx, score[t - first]);
          }
          double sum = 0;
          for (double& sc : score) sum += (sc = std::exp(sc - mx));
          for (size_t t = first; t <= p; ++t) {
            for (size_t j = 0; j < hd; ++j) {
              mixed[p * qd + hh * hd + j] += score[t - first] / sum * V[t * kvd + kh * hd + j];
            }
          }
        }
      }
    }
    Mat o = RefMatMul(mixed, lw.wo, n, qd, d);
    for (size_t i = 0; i < n * d; ++i) x[i] += o[i];
    RefRmsNorm(x, lw.mlp_norm, h, n, d, c.rms_eps);
    Mat gate = RefMatMul(h, lw.w_gate, n, d, c.intermediate);
    Mat up = RefMatMul(h, lw.w_up, n, d, c.intermediate);
    for (size_t i = 0; i < gate.size(); ++i) gate[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
    Mat down = RefMatMul(gate, lw.w_down, n, c.intermediate, d);
    for (size_t i = 0; i < n * d; ++i) x[i] += down[i];
  }
  RefRmsNorm(x, w.final_norm, h, n, d, c.rms_eps);
  return RefMatMul(h, w.lm_head, n, d, c.vocab_size);
}

// ---- The engine's path -------------------------------------------------------------------

std::vector<uint32_t> Tokens(size_t n, uint64_t seed, uint32_t vocab) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>(Mix64(seed + i) % vocab);
  return t;
}

// Logits of every position through the runner and the KV-cache manager, the prompt computed
// in chunks of the given sizes (cycled).
std::vector<float> Paged(const ModelConfig& c, const ModelWeights& w, const KvLayout& layout,
                         const std::vector<uint32_t>& tokens, std::vector<size_t> chunks) {
  KvCacheManagerOptions o;
  o.groups = layout.groups;
  o.num_blocks = 1024;
  o.prefix_caching = false;
  KvCacheManager kv(o);
  auto created = ModelRunner::Create(c, w, layout, o.num_blocks);
  EXPECT_TRUE(created.ok()) << created.status().ToString();
  ModelRunner runner = std::move(created).value();
  // Poison the pool: a read of a page the request does not own shows up as NaN.
  runner.device().Fill(runner.device_pool(), runner.host_pool().size(), std::nanf(""));
  std::vector<float> all, logits;
  size_t done = 0, step = 0;
  while (done < tokens.size()) {
    const size_t n = std::min(chunks[step++ % chunks.size()], tokens.size() - done);
    EXPECT_TRUE(kv.AllocateSlots(1, {}, tokens.size(), done, n));
    SeqInput in{std::span<const uint32_t>(tokens).subspan(done, n), done, &kv.BlockTables(1)};
    EXPECT_TRUE(runner.Forward({&in, 1}, logits, /*all_positions=*/true).ok());
    all.insert(all.end(), logits.begin(), logits.end());
    done += n;
  }
  return all;
}

double MaxRelativeError(const std::vector<float>& got, const Mat& want, size_t vocab) {
  double worst = 0;
  for (size_t row = 0; row < want.size() / vocab; ++row) {
    double scale = 0;
    for (size_t j = 0; j < vocab; ++j) scale = std::max(scale, std::abs(want[row * vocab + j]));
    for (size_t j = 0; j < vocab; ++j) {
      const double e = std::abs(got[row * vocab + j] - want[row * vocab + j]) / scale;
      if (!(e <= worst)) worst = std::isnan(e) ? INFINITY : e;
    }
  }
  return worst;
}

struct Case {
  std::string model;
  uint32_t attn_pack;
  std::vector<size_t> chunks;
};

class DenseReferenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(DenseReferenceTest, LogitsMatchWithinRelativeTolerance) {
  const Case& param = GetParam();
  auto config = ModelConfig::Load("builtin:" + param.model);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  const ModelWeights w = ModelWeights::FromSeed(*config, 11);
  auto layout = KvLayout::Build(*config, 0, param.attn_pack);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  // 100 tokens: past several 16-token blocks, the 32-token windows and the 64-token chunk.
  const std::vector<uint32_t> tokens = Tokens(100, 5, config->vocab_size);
  const Mat want = DenseReference(*config, w, tokens);
  const std::vector<float> got = Paged(*config, w, *layout, tokens, param.chunks);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LE(MaxRelativeError(got, want, config->vocab_size), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(
    BuiltinModels, DenseReferenceTest,
    ::testing::Values(Case{"tiny-full", 1, {100}}, Case{"tiny-full", 1, {7, 1, 30}},
                      Case{"tiny-full", 4, {13}}, Case{"tiny-swa", 1, {100}},
                      Case{"tiny-swa", 1, {16, 5, 1}}, Case{"tiny-hybrid", 1, {100}},
                      Case{"tiny-hybrid", 1, {9, 33}}, Case{"tiny-hybrid", 2, {1, 64}},
                      Case{"tiny-state-hybrid", 1, {100}},
                      Case{"tiny-state-hybrid", 1, {15, 2, 16}},
                      Case{"tiny-state-hybrid", 4, {100}}, Case{"tiny-state-hybrid", 4, {3, 21}}),
    [](const ::testing::TestParamInfo<Case>& param_info) {
      std::string name =
          param_info.param.model + "_pack" + std::to_string(param_info.param.attn_pack);
      for (size_t c : param_info.param.chunks) name += "_" + std::to_string(c);
      for (char& ch : name) {
        if (ch == '-') ch = '_';
      }
      return name;
    });

// Ring mode (KvLayout's swa_ring): sliding-window layers keep their KV in a ring of W tokens
// outside the pool. The same logits as the dense reference, and bitwise the same as the pool
// layout (the kernel reads the same keys in the same order), with chunks shorter and longer
// than the window of 32, for the sliding-window models (tiny-hybrid's KV-sharing layer reads a
// ring layer).
class RingDenseReferenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(RingDenseReferenceTest, LogitsMatchTheReferenceAndThePoolLayoutBitwise) {
  const Case& param = GetParam();
  auto config = ModelConfig::Load("builtin:" + param.model);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  const ModelWeights w = ModelWeights::FromSeed(*config, 11);
  auto ring = KvLayout::Build(*config, 0, param.attn_pack, /*swa_ring=*/true);
  auto pool = KvLayout::Build(*config, 0, param.attn_pack);
  ASSERT_TRUE(ring.ok() && pool.ok());
  size_t ring_groups = 0;
  for (const AttentionSpec& g : ring->groups) {
    EXPECT_EQ(g.ring, g.kind == AttentionSpec::Kind::kSlidingWindow);
    ring_groups += g.ring;
  }
  EXPECT_GT(ring_groups, 0u);
  const std::vector<uint32_t> tokens = Tokens(100, 5, config->vocab_size);
  const Mat want = DenseReference(*config, w, tokens);
  const std::vector<float> got = Paged(*config, w, *ring, tokens, param.chunks);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LE(MaxRelativeError(got, want, config->vocab_size), 1e-4);
  EXPECT_EQ(got, Paged(*config, w, *pool, tokens, param.chunks));
}

INSTANTIATE_TEST_SUITE_P(
    SlidingWindowModels, RingDenseReferenceTest,
    ::testing::Values(Case{"tiny-swa", 1, {100}}, Case{"tiny-swa", 1, {16, 5, 1}},
                      Case{"tiny-swa", 1, {40, 7}}, Case{"tiny-swa", 1, {3, 33, 50}},
                      Case{"tiny-hybrid", 1, {100}}, Case{"tiny-hybrid", 1, {9, 33}},
                      Case{"tiny-hybrid", 2, {1, 64}}, Case{"tiny-hybrid", 4, {45, 2, 31}}),
    [](const ::testing::TestParamInfo<Case>& param_info) {
      std::string name =
          param_info.param.model + "_pack" + std::to_string(param_info.param.attn_pack);
      for (size_t c : param_info.param.chunks) name += "_" + std::to_string(c);
      for (char& ch : name) {
        if (ch == '-') ch = '_';
      }
      return name;
    });

// A window shorter than a block (8 of 16) and one not a multiple of it (20), with a KV-sharing
// layer on each: the ring still matches the reference and the pool layout bitwise.
TEST(RingDenseReferenceSanity, WindowsShorterThanOrAcrossBlocks) {
  ModelConfig c = *ModelConfig::Load("builtin:tiny-hybrid");
  c.layers = {{Kind::kSlidingWindow, 8, 0, -1},  {Kind::kFull, 0, 0, -1},
              {Kind::kSlidingWindow, 20, 0, -1}, {Kind::kKvShare, 0, 0, 0},
              {Kind::kKvShare, 0, 0, 2},         {Kind::kSlidingWindow, 1, 0, -1}};
  ASSERT_TRUE(c.Validate().ok());
  const ModelWeights w = ModelWeights::FromSeed(c, 4);
  const auto ring = *KvLayout::Build(c, 16, 1, /*swa_ring=*/true);
  const auto pool = *KvLayout::Build(c, 16, 1);
  const std::vector<uint32_t> tokens = Tokens(70, 9, c.vocab_size);
  const Mat want = DenseReference(c, w, tokens);
  for (const std::vector<size_t>& chunks :
       std::vector<std::vector<size_t>>{{70}, {1}, {5, 19, 3}, {7, 30}}) {
    const std::vector<float> got = Paged(c, w, ring, tokens, chunks);
    EXPECT_LE(MaxRelativeError(got, want, c.vocab_size), 1e-4) << chunks[0];
    EXPECT_EQ(got, Paged(c, w, pool, tokens, chunks)) << chunks[0];
  }
}

// The reference itself must see what it claims to: a window that ignores old tokens.
TEST(DenseReferenceSanity, SlidingWindowIgnoresTokensOutsideTheWindow) {
  ModelConfig c = *ModelConfig::Load("builtin:tiny-swa");
  c.layers.resize(1);
  const ModelWeights w = ModelWeights::FromSeed(c, 3);
  std::vector<uint32_t> a = Tokens(40, 1, c.vocab_size), b = a;
  b[0] = (b[0] + 1) % c.vocab_size;  // outside the last position's window of 32
  const Mat la = DenseReference(c, w, a), lb = DenseReference(c, w, b);
  const size_t last = 39 * c.vocab_size;
  for (size_t j = 0; j < c.vocab_size; ++j) EXPECT_DOUBLE_EQ(la[last + j], lb[last + j]);
  EXPECT_NE(la[0], lb[0]);
}

// ---- Layout, config, weights -------------------------------------------------------------

TEST(KvLayoutTest, StateFillsAPageAndPackDividesTheAttentionBlock) {
  const ModelConfig c = *ModelConfig::Load("builtin:tiny-state-hybrid");
  auto one = KvLayout::Build(c, 0, 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->block_size, 16u);  // 4 heads * 16 * 16 floats = 16 tokens * 2 * 2 * 16
  EXPECT_EQ(one->page_floats, c.StateFloats());
  EXPECT_EQ(one->groups.size(), 7u);
  auto four = KvLayout::Build(c, 0, 4);
  ASSERT_TRUE(four.ok());
  EXPECT_EQ(four->page_floats, one->page_floats);
  ASSERT_EQ(four->groups.size(), 4u);  // 4 full layers in one page, 3 state groups
  for (const AttentionSpec& g : four->groups) EXPECT_EQ(g.block_size, 4u);
  EXPECT_EQ(four->layers[2].group, four->layers[0].group);
  EXPECT_EQ(four->layers[2].offset, 4 * c.KvFloatsPerToken());
  auto small = KvLayout::Build(c, 8, 1);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("at least 16"), std::string::npos);
  EXPECT_FALSE(KvLayout::Build(c, 16, 3).ok());
}

TEST(KvLayoutTest, KvSharingLayerReadsItsTargetsGroup) {
  const ModelConfig c = *ModelConfig::Load("builtin:tiny-hybrid");
  auto layout = KvLayout::Build(c, 16, 1);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->groups.size(), 5u);
  EXPECT_EQ(layout->layers[5].group, layout->layers[1].group);
  EXPECT_EQ(layout->groups[layout->layers[1].group].kind, AttentionSpec::Kind::kSlidingWindow);
  EXPECT_EQ(layout->groups[layout->layers[2].group].kind, AttentionSpec::Kind::kChunkedLocal);
}

TEST(ModelConfigTest, JsonRoundTripsAndBadFieldsAreNamed) {
  for (const std::string& name : ModelConfig::BuiltinNames()) {
    const ModelConfig c = *ModelConfig::Load("builtin:" + name);
    auto back = ModelConfig::FromJson(c.ToJson());
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->layers, c.layers);
    EXPECT_EQ(back->hidden, c.hidden);
    EXPECT_EQ(back->state_gate_bias, c.state_gate_bias);
  }
  auto bad =
      ModelConfig::FromJson(R"({"layers":[{"kind":"full"},{"kind":"kv_share","share_from":3}]})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("share_from 3"), std::string::npos);
  auto kind = ModelConfig::FromJson(R"({"layers":[{"kind":"mamba"}]})");
  ASSERT_FALSE(kind.ok());
  EXPECT_NE(kind.status().message().find("'mamba'"), std::string::npos);
  auto window = ModelConfig::FromJson(R"({"layers":[{"kind":"sliding_window"}]})");
  ASSERT_FALSE(window.ok());
  EXPECT_NE(window.status().message().find("'window'"), std::string::npos);
  EXPECT_FALSE(ModelConfig::FromJson(R"({"num_heads":3,"layers":[{"kind":"full"}]})").ok());
  EXPECT_FALSE(ModelConfig::FromJson("not json").ok());
  EXPECT_EQ(ModelConfig::Load("builtin:nope").status().code(), StatusCode::kNotFound);
}

TEST(ModelWeightsTest, SeededWeightsAreDeterministicAndSafetensorsRoundTrips) {
  const ModelConfig c = *ModelConfig::Load("builtin:tiny-hybrid");
  const ModelWeights a = ModelWeights::FromSeed(c, 9), b = ModelWeights::FromSeed(c, 9);
  EXPECT_EQ(a.embed, b.embed);
  EXPECT_EQ(a.layers[3].wq, b.layers[3].wq);
  EXPECT_NE(ModelWeights::FromSeed(c, 10).embed, a.embed);
  EXPECT_TRUE(a.layers[5].wk.empty());  // the KV-sharing layer has no key projection
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kvstash_weights_" + std::to_string(getpid()) + ".safetensors"))
                               .string();
  ASSERT_TRUE(a.ToSafetensors(c, path).ok());
  auto loaded = ModelWeights::FromSafetensors(c, path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->embed, a.embed);
  EXPECT_EQ(loaded->layers[2].w_down, a.layers[2].w_down);
  EXPECT_EQ(loaded->lm_head, a.lm_head);
  // The same file against another shape names the tensor.
  ModelConfig wider = c;
  wider.hidden = 32;
  auto wrong = ModelWeights::FromSafetensors(wider, path);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("'embed'"), std::string::npos);
  // A truncated file is refused, not read past its end.
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 100);
  EXPECT_FALSE(ModelWeights::FromSafetensors(c, path).ok());
  std::filesystem::remove(path);
  EXPECT_EQ(ModelWeights::FromSafetensors(c, path).status().code(), StatusCode::kNotFound);
}

// A header of the wrong types (a string for a shape, a number for a dtype, not an object) is an
// InvalidArgument naming the tensor, never an exception out of the loader.
TEST(ModelWeightsTest, MalformedSafetensorsHeadersAreRefusedNotThrown) {
  const ModelConfig c = *ModelConfig::Load("builtin:tiny-full");
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kvstash_bad_" + std::to_string(getpid()) + ".safetensors"))
                               .string();
  for (const std::string header :
       {R"({"embed": {"dtype": "F32", "shape": "256x16", "data_offsets": [0, 4]}})",
        R"({"embed": {"dtype": 7, "shape": [256, 16], "data_offsets": [0, 16384]}})",
        R"({"embed": {"dtype": "F32", "shape": [256, -16], "data_offsets": [0, 4]}})",
        R"({"embed": {"dtype": "F32", "shape": [256, 16], "data_offsets": {"a": 1}}})",
        R"({"embed": [1, 2, 3]})"}) {
    SCOPED_TRACE(header);
    {
      std::ofstream out(path, std::ios::binary);
      const uint64_t length = header.size();
      out.write(reinterpret_cast<const char*>(&length), 8);
      out << header;
    }
    auto loaded = ModelWeights::FromSafetensors(c, path);
    ASSERT_FALSE(loaded.ok());
    EXPECT_EQ(loaded.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(loaded.status().message().find("'embed'"), std::string::npos)
        << loaded.status().ToString();
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace kvstash::engine
