// y = x @ w.T (+ bias) for a few rows of x: the decode step's projections, bound by reading w.
//
//   float32:  x [M, K] float32 (rows contiguous, any row stride); wp [ceil(N / 16), K, 16] float32,
//             w [N, K] packed by services/engine/linear.py:pack_columns; bias [N] or none; y [M, N]
//   bfloat16: wp [ceil(N / 16), ceil(K / 2), 32] bfloat16 packed by pack_columns too: line (c, l)
//             holds w[16c + i, 2l + p] at 2i + p (zero past K); x, bias, y bfloat16, or float32
//             (x then rounded to bfloat16 for the dot products, y float32: the decode stack's way)
//
// A decode step reads every weight once and multiplies it by the M (<= 48) rows of the batch,
// so the time is the weights' bytes over memory bandwidth. Column block c holds
// w[16c:16c+16, :] transposed, so y[m, 16c:16c+16] = sum_k x[m, k] * wp[c, k, :] vectorizes over
// 16 outputs: one load of w, one broadcast of x per row, one FMA, no horizontal sums, and w is
// streamed once, in order. Each output is summed over k in one fixed order whatever M is, so a
// row's result does not depend on the rows beside it.
//
// bfloat16 weights are half the bytes: one 64-byte line holds 16 outputs x 2 k, and one
// vdpbf16ps (avx512_bf16) multiplies it by a broadcast pair of x and adds both products into 16
// float32 sums; y is rounded to bfloat16 (nearest even) once, at the end, after the bias, as
// oneDNN's bf16 GEMM does. Without avx512_bf16 the plain loops below serve (correct, slow), and
// has_bf16_dot() tells services/engine/linear.py to keep oneDNN instead.
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
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvbus_cpu {
namespace {

constexpr int64_t PREFETCH_LINES = 16;
#if defined(__AVX512F__)
constexpr int MAX_ROWS = 12;  // rows of one register tile (a group)
#else
constexpr int MAX_ROWS = 6;   // AVX2: 16 registers of 8 lanes hold 2 x 6 accumulators, a line and a broadcast
#endif
constexpr int SLICE_ROWS = 48;                      // rows of one call; more rows go slice by slice
constexpr int MAX_GROUPS = SLICE_ROWS / MAX_ROWS;  // groups sharing a tile

// Elements as float, and a float stored as one: float32 as is, bfloat16 (its bits in a uint16_t)
// widened exactly and rounded to nearest even.
inline float as_float(float v) { return v; }
inline float as_float(uint16_t v) { return static_cast<float>(c10::BFloat16(v, c10::BFloat16::from_bits())); }
inline void put(float* y, float v) { *y = v; }
inline void put(uint16_t* y, float v) { *y = c10::BFloat16(v).x; }

// The element types. A "line" is one 64-byte vector of a column block: 16 outputs at K_PER_LINE
// consecutive k. X is one row's x over a line's k (broadcast to every output). A is the type of
// x, the bias and y.
struct F32 {
  using W = float;
  using A = float;
  using X = float;
  static constexpr int K_PER_LINE = 1;
  static X x_of(const A* row, int64_t l, int64_t) { return row[l]; }
  static float x_part(X x, int) { return x; }
};

struct BF16 {
  using W = uint16_t;  // bfloat16 bits
  using A = uint16_t;
  using X = uint32_t;  // x[2l] in the low half, x[2l + 1] in the high half (0 past K)
  static constexpr int K_PER_LINE = 2;
  static uint32_t bits(uint16_t v) { return v; }
  static uint32_t bits(float v) { return c10::BFloat16(v).x; }  // round to nearest even
  template <class Y>
  static X x_of(const Y* row, int64_t l, int64_t K) {
    return bits(row[2 * l]) | (2 * l + 1 < K ? bits(row[2 * l + 1]) << 16 : 0u);
  }
  static float x_part(X x, int p) { return as_float(static_cast<W>(x >> (16 * p))); }
};

// bfloat16 weights, float32 rows: x is rounded to bfloat16 as the rows are laid out (what the
// dot products take), y stays float32 (the native decode stack keeps its activations in float32).
struct BF16_F32 : BF16 {
  using A = float;
};

template <class T>
constexpr int64_t LINE = 64 / sizeof(typename T::W);  // elements of one line

// NOTE: outside the AVX-512 block: the plain loops below take it too (CPUs without AVX-512).
// The shapes of one call: the packed weights (C blocks of `lines` lines), x line-major, y's rows.
template <class T>
struct Gemm {
  const typename T::W* wpp;
  int64_t C, lines, N;
  const typename T::X* xt;
  typename T::A* const* yrow;
  const typename T::A* bp;
  const typename T::W* zero_w;
};

// Tile t's NB column blocks of the packed weights; zeros stand in for blocks past the last.
template <class T, int NB>
inline void tile_blocks(const typename T::W* wpp, int64_t C, int64_t lines, int64_t t, const typename T::W* zero_w,
                        const typename T::W** w) {
  for (int b = 0; b < NB; ++b) {
    const int64_t c = t * NB + b;
    w[b] = c < C ? wpp + c * lines * LINE<T> : zero_w;
  }
}

#if defined(__AVX512F__)

// Loads, broadcasts and multiply-adds by weight type.
template <class W> struct Dot;

template <> struct Dot<float> {
  using V = __m512;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V bcast(float x) { return _mm512_set1_ps(x); }
  static __m512 mac(__m512 acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
};

inline __m512 load_bias(const float* b, __mmask16 m) { return _mm512_maskz_loadu_ps(m, b); }
inline void store_y(float* y, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(y, m, v); }

#if defined(__AVX512BF16__)
constexpr bool BF16_DOT = true;
template <> struct Dot<uint16_t> {
  using V = __m512i;
  static V load(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static V bcast(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static __m512 mac(__m512 acc, V w, V x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
};

inline __m512 load_bias(const uint16_t* b, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b)), 16));
}
inline void store_y(uint16_t* y, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(y, m, (__m256i)_mm512_cvtneps_pbh(v));
}
#else
constexpr bool BF16_DOT = false;
#endif

// y[rows, n0 : n0 + 16 * NB] for MR rows whose x is line-major in xt (row j of line l at xt[l * MR + j]).
template <class T, int NB, int MR>
inline void packed_tile(const typename T::W* const* w, const typename T::X* xt, int64_t lines,
                        typename T::A* const* yrow, const typename T::A* bp, int64_t n0, int64_t N) {
  using S = Dot<typename T::W>;
  constexpr int64_t L = LINE<T>;
  __m512 acc[NB][MR];
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < MR; ++j) acc[b][j] = _mm512_setzero_ps();
  for (int64_t l = 0; l < lines; ++l) {
    // Each line step consumes one cache line of each block; fetching 16 lines ahead lets the loads
    // overlap the FMAs once several rows make the loop compute-heavy (a prefetch past the end
    // never faults).
    typename S::V a[NB];
    for (int b = 0; b < NB; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(w[b] + (l + PREFETCH_LINES) * L), _MM_HINT_T0);
      a[b] = S::load(w[b] + l * L);
    }
    const typename T::X* xl = xt + l * MR;
    for (int j = 0; j < MR; ++j) {
      const typename S::V xv = S::bcast(xl[j]);
      for (int b = 0; b < NB; ++b) acc[b][j] = S::mac(acc[b][j], a[b], xv);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t n = n0 + b * 16;
    if (n >= N) break;
    const int64_t left = N - n;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 bv = bp ? load_bias(bp + n, mask) : _mm512_setzero_ps();
    for (int j = 0; j < MR; ++j) store_y(yrow[j] + n, mask, _mm512_add_ps(acc[b][j], bv));
  }
}

// One pass over w for MR rows: tiles of NB column blocks shared out among the threads.
template <class T, int NB, int MR>
void packed_pass(const Gemm<T>& g) {
  const int64_t tiles = (g.C + NB - 1) / NB;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const typename T::W* w[NB];
      tile_blocks<T, NB>(g.wpp, g.C, g.lines, t, g.zero_w, w);
      packed_tile<T, NB, MR>(w, g.xt, g.lines, g.yrow, g.bp, t * NB * 16, g.N);
    }
  });
}

// A tile's work for one group of mr <= MAX_ROWS rows.
template <class T, int NB>
inline void group_tile(int mr, const typename T::W* const* w, const typename T::X* xt, int64_t lines,
                       typename T::A* const* yrow, const typename T::A* bp, int64_t n0, int64_t N) {
  switch (mr) {
    case 12: packed_tile<T, NB, 12>(w, xt, lines, yrow, bp, n0, N); break;
    case 11: packed_tile<T, NB, 11>(w, xt, lines, yrow, bp, n0, N); break;
    case 10: packed_tile<T, NB, 10>(w, xt, lines, yrow, bp, n0, N); break;
    case 9: packed_tile<T, NB, 9>(w, xt, lines, yrow, bp, n0, N); break;
    case 8: packed_tile<T, NB, 8>(w, xt, lines, yrow, bp, n0, N); break;
    case 7: packed_tile<T, NB, 7>(w, xt, lines, yrow, bp, n0, N); break;
    default: packed_tile<T, NB, 6>(w, xt, lines, yrow, bp, n0, N); break;  // groups of 13+ rows hold 6-12
  }
}

// More than MAX_ROWS rows: G groups of near-equal size (group g's rows line-major at
// xt + start[g] * lines) take turns on each tile, so the tile's weights (NB x 64 bytes x lines,
// <= 196 KB for the default model in float32) come from DRAM once and from L2 for the groups
// after the first.
template <class T, int NB>
void grouped_pass(const Gemm<T>& g, const int* start, int groups) {
  const int64_t tiles = (g.C + NB - 1) / NB;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const typename T::W* w[NB];
      tile_blocks<T, NB>(g.wpp, g.C, g.lines, t, g.zero_w, w);
      for (int q = 0; q < groups; ++q)
        group_tile<T, NB>(start[q + 1] - start[q], w, g.xt + start[q] * g.lines, g.lines, g.yrow + start[q], g.bp,
                          t * NB * 16, g.N);
    }
  });
}

template <class T>
void run_simd(const Gemm<T>& g, const int* start, int groups, int64_t M) {
  if (groups > 1) {
    // NB as for one group of the largest group's size.
    if (start[1] <= 8) grouped_pass<T, 3>(g, start, groups);
    else grouped_pass<T, 2>(g, start, groups);
    return;
  }
  switch (M) {
    case 12: packed_pass<T, 2, 12>(g); break;
    case 11: packed_pass<T, 2, 11>(g); break;
    case 10: packed_pass<T, 2, 10>(g); break;
    case 9: packed_pass<T, 2, 9>(g); break;
    case 8: packed_pass<T, 3, 8>(g); break;
    case 7: packed_pass<T, 3, 7>(g); break;
    case 6: packed_pass<T, 3, 6>(g); break;
    case 5: packed_pass<T, 3, 5>(g); break;
    case 4: packed_pass<T, 4, 4>(g); break;
    case 3: packed_pass<T, 4, 3>(g); break;
    case 2: packed_pass<T, 4, 2>(g); break;
    default: packed_pass<T, 4, 1>(g); break;
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr bool BF16_DOT = false;
#define KVBUS_PACKED_AVX2 1

// AVX2 + FMA, float32 weights: the AVX-512 path's loop with each 16-output line as two 8-lane
// halves. Every output is the same chain, acc = fma(w, x, acc) over k in order, then + bias, so a
// row's result does not depend on M (nor on the tile shape chosen for it).
// NOTE: the accumulators in two arrays and every loop over them unrolled: with one
// acc[NB][MR][2] array GCC kept it on the stack and stored all of it at every k (30 GFLOP/s on
// one Zen 3 core, store-bound, where the loads allow twice that).
template <int NB, int MR>
inline void packed_tile_avx2(const float* const* w, const float* xt, int64_t lines, float* const* yrow,
                             const float* bp, int64_t n0, int64_t N) {
  __m256 lo[NB][MR], hi[NB][MR];  // outputs 0-7 and 8-15 of each block, per row
#pragma GCC unroll 16
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 16
    for (int j = 0; j < MR; ++j) lo[b][j] = hi[b][j] = _mm256_setzero_ps();
  for (int64_t l = 0; l < lines; ++l) {
    __m256 a0[NB], a1[NB];
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(w[b] + (l + PREFETCH_LINES) * 16), _MM_HINT_T0);
      a0[b] = _mm256_loadu_ps(w[b] + l * 16), a1[b] = _mm256_loadu_ps(w[b] + l * 16 + 8);
    }
    const float* xl = xt + l * MR;
#pragma GCC unroll 16
    for (int j = 0; j < MR; ++j) {
      const __m256 xv = _mm256_broadcast_ss(xl + j);
#pragma GCC unroll 16
      for (int b = 0; b < NB; ++b) {
        lo[b][j] = _mm256_fmadd_ps(a0[b], xv, lo[b][j]);
        hi[b][j] = _mm256_fmadd_ps(a1[b], xv, hi[b][j]);
      }
    }
  }
#pragma GCC unroll 16
  for (int b = 0; b < NB; ++b) {
    const int64_t n = n0 + b * 16;
    if (n >= N) break;
    const int64_t left = std::min<int64_t>(16, N - n);
    alignas(32) float bias[16] = {0};
    if (bp)
      for (int64_t i = 0; i < left; ++i) bias[i] = bp[n + i];
    const __m256 b0 = _mm256_load_ps(bias), b1 = _mm256_load_ps(bias + 8);
#pragma GCC unroll 16
    for (int j = 0; j < MR; ++j) {
      const __m256 y0 = _mm256_add_ps(lo[b][j], b0), y1 = _mm256_add_ps(hi[b][j], b1);
      if (left == 16) {
        _mm256_storeu_ps(yrow[j] + n, y0), _mm256_storeu_ps(yrow[j] + n + 8, y1);
      } else {
        alignas(32) float out[16];
        _mm256_store_ps(out, y0), _mm256_store_ps(out + 8, y1);
        std::copy(out, out + left, yrow[j] + n);
      }
    }
  }
}

template <int NB, int MR>
void packed_pass_avx2(const Gemm<F32>& g) {
  const int64_t tiles = (g.C + NB - 1) / NB;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* w[NB];
      tile_blocks<F32, NB>(g.wpp, g.C, g.lines, t, g.zero_w, w);
      packed_tile_avx2<NB, MR>(w, g.xt, g.lines, g.yrow, g.bp, t * NB * 16, g.N);
    }
  });
}

inline void group_tile_avx2(int mr, const float* const* w, const float* xt, int64_t lines, float* const* yrow,
                            const float* bp, int64_t n0, int64_t N) {
  switch (mr) {
    case 6: packed_tile_avx2<1, 6>(w, xt, lines, yrow, bp, n0, N); break;
    case 5: packed_tile_avx2<1, 5>(w, xt, lines, yrow, bp, n0, N); break;
    case 4: packed_tile_avx2<1, 4>(w, xt, lines, yrow, bp, n0, N); break;
    default: packed_tile_avx2<1, 3>(w, xt, lines, yrow, bp, n0, N); break;  // groups of 7+ rows hold 3-6
  }
}

void run_avx2(const Gemm<F32>& g, const int* start, int groups, int64_t M) {
  if (groups > 1) {  // groups take turns on each column block while it sits in L2 (see grouped_pass)
    at::parallel_for(0, g.C, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const float* w[1] = {g.wpp + c * g.lines * 16};
        for (int q = 0; q < groups; ++q)
          group_tile_avx2(start[q + 1] - start[q], w, g.xt + start[q] * g.lines, g.lines, g.yrow + start[q], g.bp,
                          c * 16, g.N);
      }
    });
    return;
  }
  switch (M) {
    case 6: packed_pass_avx2<1, 6>(g); break;
    case 5: packed_pass_avx2<1, 5>(g); break;
    case 4: packed_pass_avx2<1, 4>(g); break;
    case 3: packed_pass_avx2<1, 3>(g); break;
    case 2: packed_pass_avx2<2, 2>(g); break;
    default: packed_pass_avx2<4, 1>(g); break;
  }
}
#else
constexpr bool BF16_DOT = false;
#endif

// Neither AVX-512 nor AVX2 + FMA (or bfloat16 without avx512_bf16): plain loops over the same layout, the same
// per-output order of k (the bf16 dot product's pairs summed as pairs), correct and slower.
template <class T>
void run_plain(const Gemm<T>& g, const int* start, int groups, int64_t) {
  constexpr int64_t L = LINE<T>;
  constexpr int P = T::K_PER_LINE;
  at::parallel_for(0, g.C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const typename T::W* w = g.wpp + c * g.lines * L;
      for (int q = 0; q < groups; ++q) {
        const int mr = start[q + 1] - start[q];
        const typename T::X* xt = g.xt + start[q] * g.lines;
        for (int j = 0; j < mr; ++j)
          for (int64_t i = 0; i < 16 && c * 16 + i < g.N; ++i) {
            float s = 0.f;
            for (int64_t l = 0; l < g.lines; ++l) {
              const typename T::X xv = xt[l * mr + j];
              float pair = 0.f;
              for (int p = 0; p < P; ++p) pair += as_float(w[l * L + i * P + p]) * T::x_part(xv, p);
              s += pair;
            }
            const int64_t n = c * 16 + i;
            if (g.bp) s += as_float(g.bp[n]);
            put(&g.yrow[start[q] + j][n], s);
          }
      }
    }
  });
}

template <class T>
void packed_gemm_typed(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  using W = typename T::W;
  using A = typename T::A;
  using X = typename T::X;
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), C = wp.size(0);
  const int64_t lines = (K + T::K_PER_LINE - 1) / T::K_PER_LINE;
  TORCH_CHECK(wp.size(1) == lines && wp.size(2) == LINE<T> && y.size(0) == M && C * 16 >= N && (C - 1) * 16 < N,
              "kvbus: packed_gemm shapes disagree");
  TORCH_CHECK(x.stride(1) == 1 && wp.is_contiguous() && y.stride(1) == 1, "kvbus: packed_gemm needs contiguous rows");
  if (M == 0) return;
  const A* bp = nullptr;
  if (bias) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == x.scalar_type(),
                "kvbus: packed_gemm bias must be [N] of x's dtype");
    bp = static_cast<const A*>(bias->data_ptr());
  }
  const A* xp = static_cast<const A*>(x.data_ptr());
  A* yp = static_cast<A*>(y.data_ptr());
  const int64_t xs = x.stride(0), ys = y.stride(0);
  // More than SLICE_ROWS rows (the lm_head of a large prefill batch): one call per slice.
  if (M > SLICE_ROWS) {
    for (int64_t m0 = 0; m0 < M; m0 += SLICE_ROWS) {
      const int64_t m1 = std::min<int64_t>(M, m0 + SLICE_ROWS);
      at::Tensor ys_ = y.narrow(0, m0, m1 - m0);
      packed_gemm_typed<T>(x.narrow(0, m0, m1 - m0), wp, bias, ys_);
    }
    return;
  }
  // Rows in groups of near-equal size, at most MAX_ROWS each: 16 rows are 8 + 8, 13 are 7 + 6.
  const int groups = static_cast<int>((M + MAX_ROWS - 1) / MAX_ROWS);
  int start[MAX_GROUPS + 1];
  start[0] = 0;
  for (int q = 0; q < groups; ++q) start[q + 1] = start[q] + static_cast<int>(M / groups + (q < M % groups ? 1 : 0));
  // Per calling thread, grown once: the line-major rows of every group, and zeros for a last
  // tile short of blocks.
  thread_local std::vector<X> xt;
  thread_local std::vector<W> zero_w;
  if (xt.size() < static_cast<size_t>(lines * M)) xt.resize(lines * M);
  if (zero_w.size() < static_cast<size_t>(lines * LINE<T>)) zero_w.assign(lines * LINE<T>, W(0));
  for (int q = 0; q < groups; ++q) {
    const int mr = start[q + 1] - start[q];
    X* gxt = xt.data() + start[q] * lines;
    for (int j = 0; j < mr; ++j) {
      const A* row = xp + (start[q] + j) * xs;
      for (int64_t l = 0; l < lines; ++l) gxt[l * mr + j] = T::x_of(row, l, K);
    }
  }
  A* yrow[SLICE_ROWS];
  for (int64_t m = 0; m < M; ++m) yrow[m] = yp + m * ys;
  const Gemm<T> g{static_cast<const W*>(wp.data_ptr()), C, lines, N, xt.data(), yrow, bp, zero_w.data()};
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<typename T::W, float> || BF16_DOT) {
    run_simd<T>(g, start, groups, M);
    return;
  }
#endif
#if defined(KVBUS_PACKED_AVX2)
  if constexpr (std::is_same_v<T, F32>) {
    run_avx2(g, start, groups, M);
    return;
  }
#endif
  run_plain<T>(g, start, groups, M);
}

void packed_gemm(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && y.dim() == 2, "kvbus: packed_gemm shapes");
  const auto xt = x.scalar_type(), wt = wp.scalar_type();
  TORCH_CHECK(y.scalar_type() == xt && ((xt == at::kFloat && (wt == at::kFloat || wt == at::kBFloat16)) ||
                                        (xt == at::kBFloat16 && wt == at::kBFloat16)),
              "kvbus: packed_gemm takes float32 x and y with float32 or bfloat16 weights, or all bfloat16");
  if (wt == at::kFloat) packed_gemm_typed<F32>(x, wp, bias, y);
  else if (xt == at::kFloat) packed_gemm_typed<BF16_F32>(x, wp, bias, y);
  else packed_gemm_typed<BF16>(x, wp, bias, y);
}

bool has_bf16_dot() { return BF16_DOT; }

}  // namespace

namespace ops {
void packed_gemm(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias, at::Tensor& y) {
  kvbus_cpu::packed_gemm(x, wp, bias, y);
}
}  // namespace ops

TORCH_LIBRARY_FRAGMENT(kvbus_cpu, m) {
  m.def("packed_gemm(Tensor x, Tensor wp, Tensor? bias, Tensor(a!) y) -> ()");
  // whether bfloat16 packed GEMMs use the CPU's bf16 dot products (else: plain loops, slow)
  m.def("has_bf16_dot() -> bool", &has_bf16_dot);
}

TORCH_LIBRARY_IMPL(kvbus_cpu, CPU, m) {
  m.impl("packed_gemm", &packed_gemm);
}

}  // namespace kvbus_cpu
