// y = x @ w.T (+ bias) for a few rows of x: the decode step's projections, bound by reading w.
//
//   x    [M, K] float32, rows contiguous (any row stride)
//   w    [N, K] float32, contiguous (the checkpoint's layout: no packing, no copy)
//   bias [N] float32 or none
//   y    [M, N] float32 (written)
//
// A decode step reads every weight once and multiplies it by the M (<= ~16) rows of the batch,
// so the time is the weights' bytes over memory bandwidth. The loop streams w once: each
// thread takes a contiguous run of 4-row blocks of w; a block (4 rows x K) stays in L1 while
// it is multiplied by every row of x, 4 rows of x at a time, with 16 independent AVX-512
// accumulators. oneDNN (torch's path) reaches ~60% of the bandwidth at M = 1 and less as M
// grows; this stays near it up to M = 8 (docs/engine.md has the figures).

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

constexpr int NB = 4;  // rows of w per block
constexpr int MB = 4;  // rows of x per inner pass

#if defined(__AVX512F__)
// acc[i][j] += w_i . x_j over K (K % 16 tail masked), for NR <= 4 rows of w and MR <= 4 of x.
template <int NR, int MR>
inline void block(const float* const* wr, const float* const* xr, int64_t K, float out[NB][MB]) {
  __m512 acc[NR][MR];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[MR];
    for (int j = 0; j < MR; ++j) xv[j] = _mm512_loadu_ps(xr[j] + k);
    for (int i = 0; i < NR; ++i) {
      const __m512 wv = _mm512_loadu_ps(wr[i] + k);
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 xv[MR];
    for (int j = 0; j < MR; ++j) xv[j] = _mm512_maskz_loadu_ps(mask, xr[j] + k);
    for (int i = 0; i < NR; ++i) {
      const __m512 wv = _mm512_maskz_loadu_ps(mask, wr[i] + k);
      for (int j = 0; j < MR; ++j) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}
// The block's rows one after another (a single forward stream through w, which the hardware
// prefetcher follows best: interleaving 4 rows ran at 2/3 of this speed), MR rows of x at a
// time with two accumulators each so the FMA latency is hidden.
template <int NR, int MR>
inline void block_seq(const float* const* wr, const float* const* xr, int64_t K, float out[NB][MB]) {
  for (int i = 0; i < NR; ++i) {
    const float* w = wr[i];
    __m512 a[MR], b[MR];
    for (int j = 0; j < MR; ++j) a[j] = b[j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + k + 16);
      for (int j = 0; j < MR; ++j) {
        a[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr[j] + k), a[j]);
        b[j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr[j] + k + 16), b[j]);
      }
    }
    for (; k < K; k += 16) {
      const int64_t left = K - k;
      const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      const __m512 w0 = _mm512_maskz_loadu_ps(mask, w + k);
      for (int j = 0; j < MR; ++j) a[j] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(mask, xr[j] + k), a[j]);
    }
    for (int j = 0; j < MR; ++j) out[i][j] = _mm512_reduce_add_ps(_mm512_add_ps(a[j], b[j]));
  }
}
#else
template <int NR, int MR>
inline void block(const float* const* wr, const float* const* xr, int64_t K, float out[NB][MB]) {
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < MR; ++j) {
      float s = 0.f;
      const float* a = wr[i];
      const float* b = xr[j];
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += a[k] * b[k];
      out[i][j] = s;
    }
}
template <int NR, int MR>
inline void block_seq(const float* const* wr, const float* const* xr, int64_t K, float out[NB][MB]) {
  block<NR, MR>(wr, xr, K, out);
}
#endif

template <int NR>
inline void rows_of_x(const float* const* wr, const float* x, int64_t x_stride, int64_t M, int64_t K,
                      float out[NB][MB], float* y, int64_t y_stride, int64_t n0, const float* bias) {
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const float* xr[MB];
    const int mr = static_cast<int>(std::min<int64_t>(MB, M - m0));
    for (int j = 0; j < mr; ++j) xr[j] = x + (m0 + j) * x_stride;
    switch (mr) {
      case 4: block_seq<NR, 4>(wr, xr, K, out); break;
      case 3: block_seq<NR, 3>(wr, xr, K, out); break;
      case 2: block_seq<NR, 2>(wr, xr, K, out); break;
      default: block_seq<NR, 1>(wr, xr, K, out); break;
    }
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < mr; ++j) y[(m0 + j) * y_stride + n0 + i] = out[i][j] + (bias ? bias[n0 + i] : 0.f);
  }
}

void small_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && y.dim() == 2, "kvbus: small_gemm takes 2-d x, w, y");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "kvbus: small_gemm is float32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && y.size(0) == M && y.size(1) == N, "kvbus: small_gemm shapes disagree");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous() && y.stride(1) == 1, "kvbus: small_gemm needs contiguous rows");
  const float* bp = nullptr;
  if (bias) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "kvbus: small_gemm bias must be [N] float32");
    bp = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  const int64_t num_blocks = (N + NB - 1) / NB;
  // grain: enough blocks per thread that the pool's fork/join stays a small share
  at::parallel_for(0, num_blocks, 16, [&](int64_t begin, int64_t end) {
    float out[NB][MB];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * NB;
      const int nr = static_cast<int>(std::min<int64_t>(NB, N - n0));
      const float* wr[NB];
      for (int i = 0; i < nr; ++i) wr[i] = wp + (n0 + i) * K;
      switch (nr) {
        case 4: rows_of_x<4>(wr, xp, xs, M, K, out, yp, ys, n0, bp); break;
        case 3: rows_of_x<3>(wr, xp, xs, M, K, out, yp, ys, n0, bp); break;
        case 2: rows_of_x<2>(wr, xp, xs, M, K, out, yp, ys, n0, bp); break;
        default: rows_of_x<1>(wr, xp, xs, M, K, out, yp, ys, n0, bp); break;
      }
    }
  });
}


// ---------------------------------------------------------------------------------------------
// Packed weights: wp [ceil(N / 16), K, 16], column block c holding w[16c:16c+16, :] transposed
// (zero rows past N). Then y[m, 16c:16c+16] = sum_k x[m, k] * wp[c, k, :] vectorizes over the
// 16 outputs: one load of w, one broadcast of x per row, one FMA; no horizontal sums. Two
// column blocks x up to 8 rows of x = 16 accumulators. w is read once, in order.

#if defined(__AVX512F__)
template <int MR>
inline void packed_tile(const float* w0, const float* w1, const float* const* xr, int64_t K, __m512 acc[2][8]) {
  for (int j = 0; j < MR; ++j) acc[0][j] = acc[1][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
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
  static const float zeros_block[16] = {0};
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
  (void)zeros_block;
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
  m.def("small_gemm(Tensor x, Tensor w, Tensor? bias, Tensor(a!) y) -> ()");
  m.def("packed_gemm(Tensor x, Tensor wp, Tensor? bias, Tensor(a!) y) -> ()");
}

TORCH_LIBRARY_IMPL(kvbus_cpu, CPU, m) {
  m.impl("small_gemm", &small_gemm);
  m.impl("packed_gemm", &packed_gemm);
}

}  // namespace kvbus_cpu
