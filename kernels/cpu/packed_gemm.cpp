// y = x @ w.T (+ bias) for a few rows of x: the decode step's projections, bound by reading w.
//
//   x    [M, K] float32, rows contiguous (any row stride)
//   wp   [ceil(N / 16), K, 16] float32: w [N, K] packed by services/engine/linear.py:pack_columns
//   bias [N] float32 or none
//   y    [M, N] float32 (written)
//
// A decode step reads every weight once and multiplies it by the M (<= ~12) rows of the batch,
// so the time is the weights' bytes over memory bandwidth. Column block c holds
// w[16c:16c+16, :] transposed, so y[m, 16c:16c+16] = sum_k x[m, k] * wp[c, k, :] vectorizes over
// 16 outputs: one load of w, one broadcast of x per row, one FMA, no horizontal sums, and w is
// streamed once, in order. Each output is summed over k in one fixed order whatever M is, so a
// row's result does not depend on the rows beside it. Measured on the 2-core dev VM (all 121
// projections of SmolLM2-135M): 18-29 GB/s for 1-8 rows, against 12-17 for oneDNN's prepacked
// GEMM and 6-12 for MKL (docs/engine.md). An earlier row-major variant (a dot product per
// output) peaked at 22 GB/s at one row and fell to 12 at eight.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvbus_cpu {
namespace {

// Two column blocks x up to 8 rows of x = 16 accumulators.
constexpr int64_t PREFETCH_LINES = 16;

#if defined(__AVX512F__)
template <int MR>
inline void packed_tile(const float* w0, const float* w1, const float* const* xr, int64_t K, __m512 acc[2][8]) {
  for (int j = 0; j < MR; ++j) acc[0][j] = acc[1][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    // Each k consumes one cache line of each block; fetching 16 lines ahead lets the loads
    // overlap the FMAs once 8 rows make the loop compute-heavy (~5% at 8 rows, measured with
    // all 210 layer projections on the dev VM; a prefetch past the end never faults).
    _mm_prefetch(reinterpret_cast<const char*>(w0 + (k + PREFETCH_LINES) * 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1 + (k + PREFETCH_LINES) * 16), _MM_HINT_T0);
    const __m512 a = _mm512_loadu_ps(w0 + k * 16);
    const __m512 b = _mm512_loadu_ps(w1 + k * 16);
    for (int j = 0; j < MR; ++j) {
      const __m512 xv = _mm512_set1_ps(xr[j][k]);
      acc[0][j] = _mm512_fmadd_ps(a, xv, acc[0][j]);
      acc[1][j] = _mm512_fmadd_ps(b, xv, acc[1][j]);
    }
  }
}

void packed_gemm(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(2) == 16 && y.dim() == 2, "kvbus: packed_gemm shapes");
  TORCH_CHECK(x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "kvbus: packed_gemm is float32");
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), C = wp.size(0);
  TORCH_CHECK(wp.size(1) == K && y.size(0) == M && C * 16 >= N && (C - 1) * 16 < N, "kvbus: packed_gemm shapes disagree");
  TORCH_CHECK(x.stride(1) == 1 && wp.is_contiguous() && y.stride(1) == 1, "kvbus: packed_gemm needs contiguous rows");
  const float* bp = nullptr;
  if (bias) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "kvbus: packed_gemm bias must be [N] float32");
    bp = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wpp = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  const int64_t pairs = (C + 1) / 2;
  at::parallel_for(0, pairs, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> zero_w;  // stands in for the missing second block of an odd C
    __m512 acc[2][8];
    for (int64_t pr = begin; pr < end; ++pr) {
      const int64_t c0 = 2 * pr, c1 = c0 + 1;
      const float* w0 = wpp + c0 * K * 16;
      const float* w1;
      if (c1 < C) {
        w1 = wpp + c1 * K * 16;
      } else {
        if (zero_w.empty()) zero_w.assign(K * 16, 0.f);
        w1 = zero_w.data();
      }
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int mr = static_cast<int>(std::min<int64_t>(8, M - m0));
        const float* xr[8];
        for (int j = 0; j < mr; ++j) xr[j] = xp + (m0 + j) * xs;
        switch (mr) {
          case 8: packed_tile<8>(w0, w1, xr, K, acc); break;
          case 7: packed_tile<7>(w0, w1, xr, K, acc); break;
          case 6: packed_tile<6>(w0, w1, xr, K, acc); break;
          case 5: packed_tile<5>(w0, w1, xr, K, acc); break;
          case 4: packed_tile<4>(w0, w1, xr, K, acc); break;
          case 3: packed_tile<3>(w0, w1, xr, K, acc); break;
          case 2: packed_tile<2>(w0, w1, xr, K, acc); break;
          default: packed_tile<1>(w0, w1, xr, K, acc); break;
        }
        for (int half = 0; half < 2; ++half) {
          const int64_t n0 = (c0 + half) * 16;
          if (n0 >= N) break;
          const int64_t left = N - n0;
          const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
          const __m512 bv = bp ? _mm512_maskz_loadu_ps(mask, bp + n0) : _mm512_setzero_ps();
          for (int j = 0; j < mr; ++j)
            _mm512_mask_storeu_ps(yp + (m0 + j) * ys + n0, mask, _mm512_add_ps(acc[half][j], bv));
        }
      }
    }
  });
}
#else
void packed_gemm(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  // no AVX-512: unpack-free plain loops, correct and slower
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  auto xa = x.accessor<float, 2>();
  auto wa = wp.accessor<float, 3>();
  auto ya = y.accessor<float, 2>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float s = bias ? bias->data_ptr<float>()[n] : 0.f;
        for (int64_t k = 0; k < K; ++k) s += xa[m][k] * wa[n / 16][k][n % 16];
        ya[m][n] = s;
      }
  });
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvbus_cpu, m) {
  m.def("packed_gemm(Tensor x, Tensor wp, Tensor? bias, Tensor(a!) y) -> ()");
}

TORCH_LIBRARY_IMPL(kvbus_cpu, CPU, m) {
  m.impl("packed_gemm", &packed_gemm);
}

}  // namespace kvbus_cpu
