#pragma once

// Dense CPU operations of the engine's transformer layers. Vectorised loops over contiguous
// float32 rows (AVX2 and FMA where the CPU has them, chosen at load time); none allocates. All
// pointers are borrowed for the call; inputs and outputs never overlap unless a function says
// they may. Thread-safe (no state).

#include <cstddef>
#include <cstdint>

namespace kvstash::kernels {

// y[n][out] = x[n][in] · w[in][out] (w row-major, in rows of out columns). x rows are
// `x_stride` floats apart and y rows `y_stride` apart (0 means in / out).
void MatMul(const float* x, const float* w, float* y, size_t n, size_t in, size_t out,
            size_t x_stride = 0, size_t y_stride = 0);

// y[i] = x[i] / sqrt(mean(x[i]^2) + eps) * weight, per row of `dim`. y may equal x.
void RmsNorm(const float* x, const float* weight, float* y, size_t n, size_t dim, float eps);

// Rotary position embedding, the rotate-halves form: for each row i (rows `stride` floats
// apart) and each of its `num_heads` heads of `head_dim` (even), the pair (j, j + head_dim/2)
// rotates by a = positions[i] * theta^(-2j/head_dim):
// (x[j], x[j + head_dim/2]) becomes (x[j] cos a - x[j + head_dim/2] sin a,
// x[j] sin a + x[j + head_dim/2] cos a). In place.
void ApplyRope(float* x, size_t stride, size_t n, size_t num_heads, size_t head_dim,
               const uint32_t* positions, float theta);

// out[i] = silu(gate[i]) * up[i] for `count` floats. out may equal gate or up.
void SiluMul(const float* gate, const float* up, float* out, size_t count);

// x[i] += y[i] for `count` floats.
void AddInPlace(float* x, const float* y, size_t count);

}  // namespace kvstash::kernels
