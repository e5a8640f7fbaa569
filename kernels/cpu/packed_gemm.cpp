// y = x @ w.T (+ bias) for a few rows of x: the decode step's projections, bound by reading w.
//
//   x    [M, K] float32, rows contiguous (any row stride)
//   wp   [ceil(N / 16), K, 16] float32: w [N, K] packed by services/engine/linear.py:pack_columns
//   bias [N] float32 or none
//   y    [M, N] float32 (written)
//
// A decode step reads every weight once and multiplies it by the M (<= 48) rows of the batch,
// so the time is the weights' bytes over memory bandwidth. Column block c holds
// w[16c:16c+16, :] transposed, so y[m, 16c:16c+16] = sum_k x[m, k] * wp[c, k, :] vectorizes over
// 16 outputs: one load of w, one broadcast of x per row, one FMA, no horizontal sums, and w is
// streamed once, in order. Each output is summed over k in one fixed order whatever M is, so a
// row's result does not depend on the rows beside it.
//
// Register tiles: up to 12 rows go in one pass over w, with NB column
// blocks per tile chosen so NB x rows accumulators fit the 32 vector registers (4 blocks for up
// to 4 rows, 3 for 5-8, 2 for 9-12). The rows are first copied k-major (xt[k][row]), so a tile's
// broadcasts for one k read one or two cache lines instead of one line in each of M rows. All 121
// projections of SmolLM2-135M on the 2-core dev VM, against the previous kernel (2 blocks, rows
// read in place, passes of 8): 0.93x the time at 1 row, 0.69x at 8, 0.55x at 12; results
// bit-identical (same summation order). Earlier: 18-29 GB/s for 1-8 rows, against 12-17 for
// oneDNN's prepacked GEMM and 6-12 for MKL (docs/engine.md).
//
// 13-48 rows (decode steps that verify drafts beside many sequences): groups of <= 12 rows of
// near-equal size take turns on each tile while its weights sit in L2, so w still streams from
// DRAM once. Against oneDNN prepacked, all 121 projections: 16 rows 29.0 / 34.1 ms, 32 rows
// 53.9 / 56.6, 48 rows 71.9 / 80.4 (two passes from DRAM took 36.6 ms at 16 rows). More rows go
// 48 at a time.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvbus_cpu {
namespace {

constexpr int64_t PREFETCH_LINES = 16;
constexpr int MAX_ROWS = 12;   // rows of one register tile (a group)
constexpr int MAX_GROUPS = 4;  // groups sharing a tile (48 rows); more rows go slice by slice

#if defined(__AVX512F__)
// y[rows, n0 : n0 + 16 * NB] for MR rows whose x is k-major in xt (row j of k at xt[k * MR + j]).
template <int NB, int MR>
inline void packed_tile(const float* const* w, const float* xt, int64_t K, float* const* yrow, const float* bp,
                        int64_t n0, int64_t N) {
  __m512 acc[NB][MR];
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < MR; ++j) acc[b][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    // Each k consumes one cache line of each block; fetching 16 lines ahead lets the loads
    // overlap the FMAs once several rows make the loop compute-heavy (a prefetch past the end
    // never faults).
    __m512 a[NB];
    for (int b = 0; b < NB; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(w[b] + (k + PREFETCH_LINES) * 16), _MM_HINT_T0);
      a[b] = _mm512_loadu_ps(w[b] + k * 16);
    }
    const float* xk = xt + k * MR;
    for (int j = 0; j < MR; ++j) {
      const __m512 xv = _mm512_set1_ps(xk[j]);
      for (int b = 0; b < NB; ++b) acc[b][j] = _mm512_fmadd_ps(a[b], xv, acc[b][j]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t n = n0 + b * 16;
    if (n >= N) break;
    const int64_t left = N - n;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 bv = bp ? _mm512_maskz_loadu_ps(mask, bp + n) : _mm512_setzero_ps();
    for (int j = 0; j < MR; ++j) _mm512_mask_storeu_ps(yrow[j] + n, mask, _mm512_add_ps(acc[b][j], bv));
  }
}

// Tile t's NB column blocks of the packed weights; zeros stand in for blocks past the last.
template <int NB>
inline void tile_blocks(const float* wpp, int64_t C, int64_t K, int64_t t, const float* zero_w, const float** w) {
  for (int b = 0; b < NB; ++b) {
    const int64_t c = t * NB + b;
    w[b] = c < C ? wpp + c * K * 16 : zero_w;
  }
}

// One pass over w for MR rows: tiles of NB column blocks shared out among the threads.
template <int NB, int MR>
void packed_pass(const float* wpp, int64_t C, int64_t K, int64_t N, const float* xt, float* const* yrow,
                 const float* bp, const float* zero_w) {
  const int64_t tiles = (C + NB - 1) / NB;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* w[NB];
      tile_blocks<NB>(wpp, C, K, t, zero_w, w);
      packed_tile<NB, MR>(w, xt, K, yrow, bp, t * NB * 16, N);
    }
  });
}

// A tile's work for one group of mr <= MAX_ROWS rows.
template <int NB>
inline void group_tile(int mr, const float* const* w, const float* xt, int64_t K, float* const* yrow, const float* bp,
                       int64_t n0, int64_t N) {
  switch (mr) {
    case 12: packed_tile<NB, 12>(w, xt, K, yrow, bp, n0, N); break;
    case 11: packed_tile<NB, 11>(w, xt, K, yrow, bp, n0, N); break;
    case 10: packed_tile<NB, 10>(w, xt, K, yrow, bp, n0, N); break;
    case 9: packed_tile<NB, 9>(w, xt, K, yrow, bp, n0, N); break;
    case 8: packed_tile<NB, 8>(w, xt, K, yrow, bp, n0, N); break;
    case 7: packed_tile<NB, 7>(w, xt, K, yrow, bp, n0, N); break;
    default: packed_tile<NB, 6>(w, xt, K, yrow, bp, n0, N); break;  // groups of 13+ rows hold 6-12
  }
}

// More than MAX_ROWS rows: G groups of near-equal size (group g's rows k-major at xt + start[g] * K)
// take turns on each tile, so the tile's weights (NB x 16 columns x K, <= 196 KB for the default
// model) come from DRAM once and from L2 for the groups after the first.
template <int NB>
void grouped_pass(const float* wpp, int64_t C, int64_t K, int64_t N, const float* xt, const int* start,
                  int groups, float* const* yrow, const float* bp, const float* zero_w) {
  const int64_t tiles = (C + NB - 1) / NB;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* w[NB];
      tile_blocks<NB>(wpp, C, K, t, zero_w, w);
      for (int g = 0; g < groups; ++g)
        group_tile<NB>(start[g + 1] - start[g], w, xt + start[g] * K, K, yrow + start[g], bp, t * NB * 16, N);
    }
  });
}

void packed_gemm(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(2) == 16 && y.dim() == 2, "kvbus: packed_gemm shapes");
  TORCH_CHECK(x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "kvbus: packed_gemm is float32");
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), C = wp.size(0);
  TORCH_CHECK(wp.size(1) == K && y.size(0) == M && C * 16 >= N && (C - 1) * 16 < N, "kvbus: packed_gemm shapes disagree");
  TORCH_CHECK(x.stride(1) == 1 && wp.is_contiguous() && y.stride(1) == 1, "kvbus: packed_gemm needs contiguous rows");
  if (M == 0) return;
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
  // More than MAX_GROUPS * MAX_ROWS rows (the lm_head of a large prefill batch): one call per slice.
  if (M > MAX_GROUPS * MAX_ROWS) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_GROUPS * MAX_ROWS) {
      const int64_t m1 = std::min<int64_t>(M, m0 + MAX_GROUPS * MAX_ROWS);
      at::Tensor ys_ = y.narrow(0, m0, m1 - m0);
      packed_gemm(x.narrow(0, m0, m1 - m0), wp, bias, ys_);
    }
    return;
  }
  // Rows in groups of near-equal size, at most MAX_ROWS each: 16 rows are 8 + 8, 13 are 7 + 6.
  const int groups = static_cast<int>((M + MAX_ROWS - 1) / MAX_ROWS);
  int start[MAX_GROUPS + 1];
  start[0] = 0;
  for (int g = 0; g < groups; ++g) start[g + 1] = start[g] + static_cast<int>(M / groups + (g < M % groups ? 1 : 0));
  // Per calling thread, grown once: the k-major rows of every group, and zeros for a last tile
  // short of blocks.
  thread_local std::vector<float> xt, zero_w;
  if (xt.size() < static_cast<size_t>(K * M)) xt.resize(K * M);
  if (zero_w.size() < static_cast<size_t>(K * 16)) zero_w.assign(K * 16, 0.f);
  for (int g = 0; g < groups; ++g) {
    const int mr = start[g + 1] - start[g];
    float* gxt = xt.data() + start[g] * K;
    for (int j = 0; j < mr; ++j) {
      const float* row = xp + (start[g] + j) * xs;
      for (int64_t k = 0; k < K; ++k) gxt[k * mr + j] = row[k];
    }
  }
  float* yrow[MAX_GROUPS * MAX_ROWS];
  for (int64_t m = 0; m < M; ++m) yrow[m] = yp + m * ys;
  const float* z = zero_w.data();
  if (groups > 1) {
    // NB as for one group of the largest group's size.
    if (start[1] <= 8) grouped_pass<3>(wpp, C, K, N, xt.data(), start, groups, yrow, bp, z);
    else grouped_pass<2>(wpp, C, K, N, xt.data(), start, groups, yrow, bp, z);
    return;
  }
  switch (M) {
    case 12: packed_pass<2, 12>(wpp, C, K, N, xt.data(), yrow, bp, z); break;
    case 11: packed_pass<2, 11>(wpp, C, K, N, xt.data(), yrow, bp, z); break;
    case 10: packed_pass<2, 10>(wpp, C, K, N, xt.data(), yrow, bp, z); break;
    case 9: packed_pass<2, 9>(wpp, C, K, N, xt.data(), yrow, bp, z); break;
    case 8: packed_pass<3, 8>(wpp, C, K, N, xt.data(), yrow, bp, z); break;
    case 7: packed_pass<3, 7>(wpp, C, K, N, xt.data(), yrow, bp, z); break;
    case 6: packed_pass<3, 6>(wpp, C, K, N, xt.data(), yrow, bp, z); break;
    case 5: packed_pass<3, 5>(wpp, C, K, N, xt.data(), yrow, bp, z); break;
    case 4: packed_pass<4, 4>(wpp, C, K, N, xt.data(), yrow, bp, z); break;
    case 3: packed_pass<4, 3>(wpp, C, K, N, xt.data(), yrow, bp, z); break;
    case 2: packed_pass<4, 2>(wpp, C, K, N, xt.data(), yrow, bp, z); break;
    default: packed_pass<4, 1>(wpp, C, K, N, xt.data(), yrow, bp, z); break;
  }
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

namespace ops {
void packed_gemm(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  kvbus_cpu::packed_gemm(x, wp, bias, y);
}
}  // namespace ops

TORCH_LIBRARY_FRAGMENT(kvbus_cpu, m) {
  m.def("packed_gemm(Tensor x, Tensor wp, Tensor? bias, Tensor(a!) y) -> ()");
}

TORCH_LIBRARY_IMPL(kvbus_cpu, CPU, m) {
  m.impl("packed_gemm", &packed_gemm);
}

}  // namespace kvbus_cpu
