// Paged attention on the CPU, reading the paged KV cache in place (no per-step gather).
//
// One op serves decode and prefill/extend:
//   q            [T, Hq, D]  float32 | bfloat16 (packed new tokens of B sequences)
//   k/v_cache    [num_pages, page_size, Hkv, D], any page/token/head strides, D contiguous;
//                float32 | bfloat16 | float8_e4m3fn (fp8 with k_scale / v_scale, 0-d or [Hkv])
//   block_tables [B, max_pages] int32
//   cu_seqlens_q [B + 1] int32, or empty for decode (sequence b owns q row b)
//   seq_lens     [B] int32: cached prefix + new tokens
//   out          [T, Hq, D], dtype of q (written)
// New token i of sequence b sits at position seq_lens[b] - q_len_b + i and attends to every
// position <= its own; query head h reads KV head h / (Hq / Hkv).
//
// Work: one task per (sequence, block of <= 32 new tokens, group of KV heads, KV split). A task
// holds the rows of its block times the GQA group (each KV tile is read once for all of them),
// walks its KV range in tiles (32 tokens with AVX-512, else 16) with an online softmax, writes the
// normalized rows or, when the KV range was split (long decode contexts with few sequences, so
// that every thread has work), a partial (max, sum, acc) that a second pass merges. With AVX-512
// and head_dim 64 or 128, a task of 16 or more rows (prefill/extend) puts its rows in vector lanes
// (attend_lanes) and a smaller one (decode) keeps a row per register block over a transposed K
// tile (attend_wide); both give a row the same bits. Tasks are handed out
// dynamically over torch's own OpenMP pool (at::parallel_for), so the op uses the threads that
// torch.set_num_threads gave the process and never oversubscribes.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace kvbus_cpu {
namespace {

constexpr int TILE = 16;          // KV tokens per tile
constexpr int BLOCK_M = 32;       // new tokens per task (prefill/extend)
constexpr int SPLIT_TOKENS = 512; // smallest KV range a split task covers

#if defined(__AVX512F__)
#define KVBUS_AVX512 1

inline __mmask16 lanes(int count) {  // the first `count` of 16 lanes (count may be <= 0 or >= 16)
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

// In-register 16 x 16 transpose: r[i] holds row i on entry, column i on exit.
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

// Sum of a 32-token tile's softmax weights in one fixed order, (p_j + p_j+16), then lanes i and i+8,
// i and i+4, i and i+2, 0 and 1: the rows-in-lanes path (attend_lanes) adds in the same order, so a
// row gets the same bits from either path.
inline float tree_sum32(__m512 pa, __m512 pb) {
  const __m512 a = _mm512_add_ps(pa, pb);
  const __m256 b = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
  const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}
#endif

struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i)
      v[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
};
const Fp8Table& fp8_table() {
  static const Fp8Table table;
  return table;
}

// Convert one KV row of D elements to float.
inline void load_row(const float* src, float* dst, int d) { std::memcpy(dst, src, sizeof(float) * d); }
inline void load_row(const c10::BFloat16* src, float* dst, int d) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int i = 0; i < d; ++i) {
    uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    dst[i] = f;
  }
}
inline void load_row(const c10::Float8_e4m3fn* src, float* dst, int d) {
  const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
  const float* table = fp8_table().v;
  for (int i = 0; i < d; ++i) dst[i] = table[s[i]];
}

struct Params {
  const int32_t* block_tables;
  int64_t bt_stride;
  const char* k_base;
  const char* v_base;
  int64_t k_stride_page, k_stride_tok, k_stride_head;  // in elements
  int64_t v_stride_page, v_stride_tok, v_stride_head;
  int page_size, num_kv_heads, group, head_dim;
};

#if defined(KVBUS_AVX512)
// Prefetch one line into L2 (and L1). Inline asm, not _mm_prefetch: GCC deletes a loop whose only
// statements are __builtin_prefetch calls (it has no side effects), and TileWalk::prefetch is such
// a loop. With _mm_prefetch the build carried no prefetch at all, and 30 layers of 4 x 3,000-token
// decode took 1.85x their time now (tests/kernels/test_attention_cpu.py checks the build).
inline void prefetch_l2(const char* line) { asm volatile("prefetcht1 %0" : : "m"(*line)); }

// Many rows (prefill/extend blocks): 32-token KV tiles, S = Q.K^T four rows at a time from a
// transposed tile (one broadcast-FMA per d into 8 register accumulators), a vector softmax per
// row, and P.V with the row's accumulator held in registers.
constexpr int TILE_WIDE = 32;

// Walks a sequence's KV tokens [k0, k1) in tiles of TILE_WIDE: where each token's K and V rows
// start (pages walked without a division per token), and an L2 prefetch of the next tile's rows
// for heads h0 .. h0 + nh - 1 while this one computes: pages sit anywhere in the pool, so the
// hardware prefetcher has to find every page's stream anew. Two ways to prefetch:
//  - burst: the whole next tile when the walk moves to a tile (prefill/extend, compute-bound);
//  - spread (paced > 0): the next tile's lines are queued in the order they will be read and the
//    compute loops issue `step` of them at each of the `paced` points per head they pass
//    (pace()). Decode is bound by memory: a burst of 768 prefetches at a tile's start fills the
//    core's miss queue and the tile's own loads wait behind it. 30 layers of 4 x 3,000-token
//    decode on 2 cores: ~11 GB/s with no prefetch, ~13 burst, ~19 spread.
template <typename KV, int D>
struct TileWalk {
  static constexpr int ROW_LINES = (D * static_cast<int>(sizeof(KV)) + 63) / 64;
  const Params& p;
  const int32_t* table;
  int k1, h0, nh, page_idx, slot, n = 0;
  int64_t kbase[TILE_WIDE], vbase[TILE_WIDE];  // the current tile's K / V row offsets (head 0)
  const float* krow[TILE_WIDE];                // its rows of the head last given to rows()
  const float* vrow[TILE_WIDE];
  const int paced;                 // issue points per head (0: burst)
  std::vector<const char*> lines;  // spread: the next tile's lines, head by head, K rows then V rows
  int queued = 0, issued = 0, step = 1;
  TileWalk(const Params& p_, int b, int k0, int k1_, int h0_, int nh_, int paced_ = 0)
      : p(p_), table(p_.block_tables + static_cast<int64_t>(b) * p_.bt_stride), k1(k1_), h0(h0_), nh(nh_),
        page_idx(k0 / p_.page_size), slot(k0 % p_.page_size), paced(paced_),
        lines(paced_ > 0 ? static_cast<size_t>(nh_) * 2 * TILE_WIDE * ROW_LINES : 0) {}

  // Moves to the tile starting at t0: its tokens' element offsets (head 0); returns its token count.
  int next(int t0) {
    n = std::min(TILE_WIDE, k1 - t0);
    for (int j = 0; j < n; ++j) {
      const int64_t page = table[page_idx];
      kbase[j] = page * p.k_stride_page + slot * p.k_stride_tok;
      vbase[j] = page * p.v_stride_page + slot * p.v_stride_tok;
      if (++slot == p.page_size) slot = 0, ++page_idx;
    }
    if (paced > 0) {
      pace(queued - issued);  // what the last tile's loops did not get to
      queue(t0 + n);
    } else {
      prefetch(t0 + n);
    }
    return n;
  }

  // The current tile's K and V rows of head h as float, into krow / vrow: in place for an fp32
  // cache, else converted into K / V ([TILE_WIDE, D] scratch).
  void rows(int h, float* K, float* V) {
    const KV* kc = reinterpret_cast<const KV*>(p.k_base);
    const KV* vc = reinterpret_cast<const KV*>(p.v_base);
    for (int j = 0; j < n; ++j) {
      const KV* ks = kc + kbase[j] + h * p.k_stride_head;
      const KV* vs = vc + vbase[j] + h * p.v_stride_head;
      if constexpr (std::is_same_v<KV, float>) {
        krow[j] = ks, vrow[j] = vs;
      } else {
        load_row(ks, K + j * D, D), load_row(vs, V + j * D, D);
        krow[j] = K + j * D, vrow[j] = V + j * D;
      }
    }
  }

  // Spread mode: issues the next `count` queued lines.
  inline void pace(int count) {
    const int end = std::min(queued, issued + count);
    for (; issued < end; ++issued) prefetch_l2(lines[issued]);
  }

  // Prefetches the tile starting at token tok (T1: into L2) for heads h0 .. h0 + nh - 1.
  void prefetch(int tok) {
    if (tok >= k1) return;
    const KV* kc = reinterpret_cast<const KV*>(p.k_base);
    const KV* vc = reinterpret_cast<const KV*>(p.v_base);
    const int n_next = std::min(TILE_WIDE, k1 - tok);
    int pi = tok / p.page_size, sl = tok % p.page_size;
    constexpr int row_bytes = D * static_cast<int>(sizeof(KV));
    for (int j = 0; j < n_next; ++j) {
      const int64_t page = table[pi];
      const char* kr = reinterpret_cast<const char*>(kc + page * p.k_stride_page + sl * p.k_stride_tok + h0 * p.k_stride_head);
      const char* vr = reinterpret_cast<const char*>(vc + page * p.v_stride_page + sl * p.v_stride_tok + h0 * p.v_stride_head);
      for (int hi = 0; hi < nh; ++hi) {
        for (int off = 0; off < row_bytes; off += 64) {
          prefetch_l2(kr + hi * p.k_stride_head * static_cast<int64_t>(sizeof(KV)) + off);
          prefetch_l2(vr + hi * p.v_stride_head * static_cast<int64_t>(sizeof(KV)) + off);
        }
      }
      if (++sl == p.page_size) sl = 0, ++pi;
    }
  }

  // Spread mode: queues the lines of the tile starting at token tok and sets the pace. The queue
  // is in read order (head by head, K rows then V rows); the burst above walks address order
  // (a token's heads are adjacent). A burst through this queue was no better for extend
  // (4 x 256 new tokens over 3,000: 1,544-1,641 ms against 1,460-1,586 ms, alternating builds),
  // so the two walks stay separate.
  void queue(int tok) {
    queued = issued = 0;
    if (tok >= k1) return;
    const int n_next = std::min(TILE_WIDE, k1 - tok);
    int pi = tok / p.page_size, sl = tok % p.page_size;
    const char* kr[TILE_WIDE];
    const char* vr[TILE_WIDE];
    constexpr int64_t es = sizeof(KV);
    for (int j = 0; j < n_next; ++j) {
      const int64_t page = table[pi];
      kr[j] = p.k_base + (page * p.k_stride_page + sl * p.k_stride_tok + h0 * p.k_stride_head) * es;
      vr[j] = p.v_base + (page * p.v_stride_page + sl * p.v_stride_tok + h0 * p.v_stride_head) * es;
      if (++sl == p.page_size) sl = 0, ++pi;
    }
    for (int hi = 0; hi < nh; ++hi) {
      for (int j = 0; j < n_next; ++j)
        for (int c = 0; c < ROW_LINES; ++c) lines[queued++] = kr[j] + hi * p.k_stride_head * es + 64 * c;
      for (int j = 0; j < n_next; ++j)
        for (int c = 0; c < ROW_LINES; ++c) lines[queued++] = vr[j] + hi * p.v_stride_head * es + 64 * c;
    }
    step = (queued / nh + paced - 1) / paced;
  }
};

template <typename KV, int D>
void attend_wide(const Params& p, int b, int h0, int nh, const float* Q_all, const int* limits, int R, int k0,
                 int k1, float* acc_all, float* m_all, float* l_all, float* scratch) {
  // Heads h0 .. h0 + nh - 1, their rows one after another (R each, same limits); each 32-token
  // tile is walked once for all of them, so a page's K and V are read in address order.
  constexpr int TN = TILE_WIDE, ND = D / 16;
  constexpr int RB = D == 64 ? 4 : 2;  // rows per P.V block (RB * ND accumulators in registers)
  float* K = scratch;          // [TN, D] converted rows (non-fp32 caches)
  float* V = K + TN * D;       // [TN, D]
  float* Kt = V + TN * D;      // [D, TN]
  float* S = Kt + TN * D;      // [R, TN]
  for (int r = 0; r < nh * R; ++r) m_all[r] = -std::numeric_limits<float>::infinity(), l_all[r] = 0.f;
  std::fill(acc_all, acc_all + static_cast<int64_t>(nh) * R * D, 0.f);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // the points per head where the loops below pace the next tile's prefetch: each transpose block,
  // every 8 d of a QK row block, every 4 keys of a P.V row block
  constexpr int BLOCKS = (TN / 16) * (D / 16);
  const int paced = BLOCKS + (R / 4 + R % 4) * (D / 8) + (R / RB + R % RB) * (TN / 4);
  TileWalk<KV, D> walk(p, b, k0, k1, h0, nh, paced);
  for (int t0 = k0; t0 < k1; t0 += TN) {
    const int n = walk.next(t0);
    for (int hi = 0; hi < nh; ++hi) {
    const int h = h0 + hi;
    const float* Q = Q_all + static_cast<int64_t>(hi) * R * D;
    float* acc = acc_all + static_cast<int64_t>(hi) * R * D;
    float* m = m_all + hi * R;
    float* l = l_all + hi * R;
    walk.rows(h, K, V);
    // Kt [D, TN] by 16 x 16 blocks transposed in registers (a scalar gather cost more than the
    // whole QK for decode's few rows)
    for (int jb = 0; jb < TN; jb += 16) {
      for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 blk[16];
        for (int j = 0; j < 16; ++j)
          blk[j] = jb + j < n ? _mm512_loadu_ps(walk.krow[jb + j] + d0) : _mm512_setzero_ps();
        transpose16(blk);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(Kt + (d0 + i) * TN + jb, blk[i]);
        walk.pace(walk.step);
      }
    }
    int r = 0;
    for (; r + 4 <= R; r += 4) {
      __m512 s0a = _mm512_setzero_ps(), s0b = s0a, s1a = s0a, s1b = s0a, s2a = s0a, s2b = s0a, s3a = s0a, s3b = s0a;
      const float* q0 = Q + r * D;
      for (int d = 0; d < D; ++d) {
        if (d % 8 == 0) walk.pace(walk.step);
        const __m512 ka = _mm512_loadu_ps(Kt + d * TN), kb = _mm512_loadu_ps(Kt + d * TN + 16);
        __m512 q = _mm512_set1_ps(q0[d]);
        s0a = _mm512_fmadd_ps(q, ka, s0a), s0b = _mm512_fmadd_ps(q, kb, s0b);
        q = _mm512_set1_ps(q0[D + d]);
        s1a = _mm512_fmadd_ps(q, ka, s1a), s1b = _mm512_fmadd_ps(q, kb, s1b);
        q = _mm512_set1_ps(q0[2 * D + d]);
        s2a = _mm512_fmadd_ps(q, ka, s2a), s2b = _mm512_fmadd_ps(q, kb, s2b);
        q = _mm512_set1_ps(q0[3 * D + d]);
        s3a = _mm512_fmadd_ps(q, ka, s3a), s3b = _mm512_fmadd_ps(q, kb, s3b);
      }
      float* srow = S + r * TN;
      _mm512_storeu_ps(srow, s0a), _mm512_storeu_ps(srow + 16, s0b);
      _mm512_storeu_ps(srow + TN, s1a), _mm512_storeu_ps(srow + TN + 16, s1b);
      _mm512_storeu_ps(srow + 2 * TN, s2a), _mm512_storeu_ps(srow + 2 * TN + 16, s2b);
      _mm512_storeu_ps(srow + 3 * TN, s3a), _mm512_storeu_ps(srow + 3 * TN + 16, s3b);
    }
    for (; r < R; ++r) {
      __m512 sa = _mm512_setzero_ps(), sb = sa;
      const float* q0 = Q + r * D;
      for (int d = 0; d < D; ++d) {
        if (d % 8 == 0) walk.pace(walk.step);
        const __m512 q = _mm512_set1_ps(q0[d]);
        sa = _mm512_fmadd_ps(q, _mm512_loadu_ps(Kt + d * TN), sa);
        sb = _mm512_fmadd_ps(q, _mm512_loadu_ps(Kt + d * TN + 16), sb);
      }
      _mm512_storeu_ps(S + r * TN, sa), _mm512_storeu_ps(S + r * TN + 16, sb);
    }
    // Softmax of RB rows into P, then P.V for the RB rows at once: RB x ND accumulators stay in
    // registers and every V row loaded serves RB rows (one row at a time, P.V was bound by its V
    // loads). A row's arithmetic is the same whichever rows share its block: a row that sees
    // fewer of the tile's tokens than its neighbours gets p = 0 for the rest (fma(0, v, a) == a).
    alignas(64) float P[RB][TN];
    float alpha[RB];
    for (r = 0; r < R; r += RB) {
      const int rb = std::min(RB, R - r);
      int vmax = 0;
      for (int i = 0; i < rb; ++i) {
        const int rr = r + i;
        const int visible = std::min(n, limits[rr] - t0);
        if (visible <= 0) {
          alpha[i] = 1.f;
          _mm512_store_ps(P[i], _mm512_setzero_ps()), _mm512_store_ps(P[i] + 16, _mm512_setzero_ps());
          continue;
        }
        vmax = std::max(vmax, visible);
        const __mmask16 ma = lanes(visible), mb = lanes(visible - 16);
        const __m512 sa = _mm512_mask_loadu_ps(ninf, ma, S + rr * TN);
        const __m512 sb = _mm512_mask_loadu_ps(ninf, mb, S + rr * TN + 16);
        const float mx = std::max(m[rr], _mm512_reduce_max_ps(_mm512_max_ps(sa, sb)));
        const __m512 mv = _mm512_set1_ps(mx);
        const __m512 pa = _mm512_maskz_mov_ps(ma, exp512(_mm512_sub_ps(sa, mv)));
        const __m512 pb = _mm512_maskz_mov_ps(mb, exp512(_mm512_sub_ps(sb, mv)));
        alpha[i] = _mm512_cvtss_f32(exp512(_mm512_set1_ps(m[rr] - mx)));
        l[rr] = std::fma(l[rr], alpha[i], tree_sum32(pa, pb));
        m[rr] = mx;
        _mm512_store_ps(P[i], pa), _mm512_store_ps(P[i] + 16, pb);
      }
      if (vmax == 0) continue;
      if (rb == RB) {
        __m512 a[RB][ND];
        for (int i = 0; i < RB; ++i) {
          const __m512 al = _mm512_set1_ps(alpha[i]);
          const float* arow = acc + static_cast<int64_t>(r + i) * D;
          for (int k = 0; k < ND; ++k) a[i][k] = _mm512_mul_ps(_mm512_loadu_ps(arow + 16 * k), al);
        }
        for (int j = 0; j < vmax; ++j) {
          if (j % 4 == 0) walk.pace(walk.step);
          const float* v = walk.vrow[j];
          __m512 vv[ND];
          for (int k = 0; k < ND; ++k) vv[k] = _mm512_loadu_ps(v + 16 * k);
          for (int i = 0; i < RB; ++i) {
            const __m512 w = _mm512_set1_ps(P[i][j]);
            for (int k = 0; k < ND; ++k) a[i][k] = _mm512_fmadd_ps(w, vv[k], a[i][k]);
          }
        }
        for (int i = 0; i < RB; ++i) {
          float* arow = acc + static_cast<int64_t>(r + i) * D;
          for (int k = 0; k < ND; ++k) _mm512_storeu_ps(arow + 16 * k, a[i][k]);
        }
      } else {
        for (int i = 0; i < rb; ++i) {
          float* arow = acc + static_cast<int64_t>(r + i) * D;
          __m512 a[ND];
          const __m512 al = _mm512_set1_ps(alpha[i]);
          for (int k = 0; k < ND; ++k) a[k] = _mm512_mul_ps(_mm512_loadu_ps(arow + 16 * k), al);
          for (int j = 0; j < vmax; ++j) {
            if (j % 4 == 0) walk.pace(walk.step);
            const __m512 w = _mm512_set1_ps(P[i][j]);
            const float* v = walk.vrow[j];
            for (int k = 0; k < ND; ++k) a[k] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * k), a[k]);
          }
          for (int k = 0; k < ND; ++k) _mm512_storeu_ps(arow + 16 * k, a[k]);
        }
      }
    }
    }  // heads
  }
}

// Blocks of >= 16 rows (prefill/extend): rows in lanes. One vector holds a 16-row group's scores
// for one key, so the online softmax is vertical (the row path's per-row max and sum reduce
// across lanes, a chain of shuffles that serialized its softmax), and S needs no transposed K:
// S[j] += K[j][d] (a broadcast) * Qt[d]. Per row it is the row path's arithmetic, bit for bit:
// the same tiles, the same fma chains over d and over j, the same order of the tile's sum
// (tree_sum32), the same exp; so a row's result never depends on how many rows share its task.
// Up to GROUPS_MAX groups go through S = Q.K^T and P.V together: each broadcast K or V element
// then feeds GROUPS_MAX FMAs (one group a time, the loop issued about one load per FMA; with two,
// the extend attention of a 3,000-token context ran ~10% faster; with three it spilled). A group
// that sees fewer of the tile's keys than its neighbours gets weights 0 for the rest (and alpha 1
// when it sees none): fma(0, v, a) == a, so its rows keep their own arithmetic.
constexpr int LANES = 16;
constexpr int GROUPS_MAX = 2;

inline int lane_rows(int R) { return (R + LANES - 1) / LANES * LANES; }

// S_b[j] = Q_b . K[j] for keys [0, jmax) of the tile and NB groups b (S_b = S + b * TN * L).
template <int NB, int D>
inline void scores_block(const float* const* krow, const float* zero, int jmax, const float* const* qt, float* S) {
  constexpr int L = LANES, JK = 8, TN = TILE_WIDE;
  for (int j0 = 0; j0 < jmax; j0 += JK) {
    const float* kr[JK];
    for (int jj = 0; jj < JK; ++jj) kr[jj] = j0 + jj < jmax ? krow[j0 + jj] : zero;
    __m512 s[NB][JK];
    for (int b = 0; b < NB; ++b)
      for (int jj = 0; jj < JK; ++jj) s[b][jj] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
      __m512 qv[NB];
      for (int b = 0; b < NB; ++b) qv[b] = _mm512_loadu_ps(qt[b] + d * L);
      for (int jj = 0; jj < JK; ++jj) {
        const __m512 kb = _mm512_set1_ps(kr[jj][d]);
        for (int b = 0; b < NB; ++b) s[b][jj] = _mm512_fmadd_ps(kb, qv[b], s[b][jj]);
      }
    }
    for (int b = 0; b < NB; ++b)
      for (int jj = 0; jj < JK && j0 + jj < jmax; ++jj) _mm512_storeu_ps(S + b * TN * L + (j0 + jj) * L, s[b][jj]);
  }
}

// at_b = at_b * alpha_b + sum over keys [0, jmax) of P_b[j] * V[j], NB groups, DC dims at a time.
template <int NB, int D>
inline void values_block(const float* const* vrow, int jmax, const float* S, const __m512* alpha, float* const* at) {
  // NB * DC accumulators plus NB weight vectors stay in the 32 registers (2 x 16 spilled five of
  // them to the stack: a load and a store per key)
  constexpr int L = LANES, DC = NB == 1 ? 16 : 8, TN = TILE_WIDE;
  for (int d0 = 0; d0 < D; d0 += DC) {
    __m512 a[NB][DC];
    for (int b = 0; b < NB; ++b)
      for (int k = 0; k < DC; ++k) a[b][k] = _mm512_mul_ps(_mm512_loadu_ps(at[b] + (d0 + k) * L), alpha[b]);
    for (int j = 0; j < jmax; ++j) {
      __m512 pv[NB];
      for (int b = 0; b < NB; ++b) pv[b] = _mm512_loadu_ps(S + b * TN * L + j * L);
      const float* v = vrow[j] + d0;
      for (int k = 0; k < DC; ++k) {
        const __m512 vb = _mm512_set1_ps(v[k]);
        for (int b = 0; b < NB; ++b) a[b][k] = _mm512_fmadd_ps(vb, pv[b], a[b][k]);
      }
    }
    for (int b = 0; b < NB; ++b)
      for (int k = 0; k < DC; ++k) _mm512_storeu_ps(at[b] + (d0 + k) * L, a[b][k]);
  }
}

// One group alone: compiled out of line (inlined into the dispatch, GCC's code for it ran at
// half the speed).
template <int D>
__attribute__((noinline)) void scores_one(const float* const* krow, const float* zero, int jmax, const float* const* qt, float* S) {
  scores_block<1, D>(krow, zero, jmax, qt, S);
}

template <int D>
__attribute__((noinline)) void values_one(const float* const* vrow, int jmax, const float* S, const __m512* alpha, float* const* at) {
  values_block<1, D>(vrow, jmax, S, alpha, at);
}

template <int D>
inline void scores_groups(int nb, const float* const* krow, const float* zero, int jmax, const float* const* qt, float* S) {
  switch (nb) {
    case 1: scores_one<D>(krow, zero, jmax, qt, S); break;
    default: scores_block<2, D>(krow, zero, jmax, qt, S); break;
  }
}

template <int D>
inline void values_groups(int nb, const float* const* vrow, int jmax, const float* S, const __m512* alpha, float* const* at) {
  switch (nb) {
    case 1: values_one<D>(vrow, jmax, S, alpha, at); break;
    default: values_block<2, D>(vrow, jmax, S, alpha, at); break;
  }
}

template <typename KV, int D>
void attend_lanes(const Params& p, int b, int h0, int nh, const float* Q_all, const int* limits, int R, int k0,
                  int k1, float* acc_all, float* m_all, float* l_all, float* scratch) {
  constexpr int TN = TILE_WIDE, L = LANES;
  static_assert(GROUPS_MAX == 2, "scores_groups / values_groups dispatch up to 2 groups");
  const int groups = lane_rows(R) / L;
  const int64_t group_floats = static_cast<int64_t>(D) * L;
  float* K = scratch;                                     // [TN, D] converted rows (non-fp32 caches)
  float* V = K + TN * D;                                  // [TN, D]
  float* S = V + TN * D;                                  // [GROUPS_MAX, TN, L] scores, then weights
  float* zero = S + GROUPS_MAX * TN * L;                  // [D] a key row for a chunk's missing keys
  float* Qt = zero + D;                                   // [nh, groups, D, L]
  float* At = Qt + nh * groups * group_floats;            // [nh, groups, D, L] accumulators
  float* Mv = At + nh * groups * group_floats;            // [nh, groups, L]
  float* Lv = Mv + nh * groups * L;                       // [nh, groups, L]
  int* lim = reinterpret_cast<int*>(Lv + nh * groups * L);  // [groups, L]; padding lanes see nothing
  std::fill(zero, zero + D, 0.f);
  for (int r = 0; r < groups * L; ++r) lim[r] = r < R ? limits[r] : 0;
  for (int hi = 0; hi < nh; ++hi) {
    for (int g = 0; g < groups; ++g) {
      float* qt = Qt + (hi * groups + g) * group_floats;
      for (int i = 0; i < L; ++i) {
        const int r = g * L + i;
        const float* q = Q_all + (static_cast<int64_t>(hi) * R + r) * D;
        for (int d = 0; d < D; ++d) qt[d * L + i] = r < R ? q[d] : 0.f;
      }
    }
  }
  std::fill(At, At + nh * groups * group_floats, 0.f);
  std::fill(Mv, Mv + nh * groups * L, -std::numeric_limits<float>::infinity());
  std::fill(Lv, Lv + nh * groups * L, 0.f);
  const __m512 one = _mm512_set1_ps(1.f);
  TileWalk<KV, D> walk(p, b, k0, k1, h0, nh);
  for (int t0 = k0; t0 < k1; t0 += TN) {
    const int n = walk.next(t0);
    for (int hi = 0; hi < nh; ++hi) {
      walk.rows(h0 + hi, K, V);
      for (int g0 = 0; g0 < groups; g0 += GROUPS_MAX) {
        const int nb = std::min(GROUPS_MAX, groups - g0);
        int jm[GROUPS_MAX];  // keys of this tile any lane of each group sees
        int jmax = 0;        // ... and of the block
        for (int bi = 0; bi < nb; ++bi) {
          int j = 0;
          for (int i = 0; i < L; ++i) j = std::max(j, lim[(g0 + bi) * L + i] - t0);
          jm[bi] = std::min(j, n);
          jmax = std::max(jmax, jm[bi]);
        }
        if (jmax <= 0) continue;
        const int64_t gi0 = hi * groups + g0;
        const float* qt[GROUPS_MAX];
        float* at[GROUPS_MAX];
        __m512 alpha[GROUPS_MAX];
        for (int bi = 0; bi < nb; ++bi) {
          qt[bi] = Qt + (gi0 + bi) * group_floats;
          at[bi] = At + (gi0 + bi) * group_floats;
        }
        scores_groups<D>(nb, walk.krow, zero, jmax, qt, S);
        for (int bi = 0; bi < nb; ++bi) {
          float* Sb = S + bi * TN * L;
          const int jg = jm[bi];
          if (jg <= 0) {  // no lane of this group sees the tile: weights 0, nothing rescaled
            for (int j = 0; j < jmax; ++j) _mm512_storeu_ps(Sb + j * L, _mm512_setzero_ps());
            alpha[bi] = one;
            continue;
          }
          const int* lg = lim + (g0 + bi) * L;
          // online softmax across the tile, lane-wise; a lane whose row sees none of it is unchanged
          const __m512i rel = _mm512_sub_epi32(_mm512_loadu_si512(lg), _mm512_set1_epi32(t0));
          const __mmask16 any = _mm512_cmpgt_epi32_mask(rel, _mm512_setzero_si512());
          float* mp = Mv + (gi0 + bi) * L;
          float* lp = Lv + (gi0 + bi) * L;
          const __m512 m_old = _mm512_loadu_ps(mp);
          __m512 mx = m_old;
          __m512 w[TN];
          // Every lane sees every key up to jg (all but a prompt's diagonal tiles): no masks, and
          // the max in four independent chains (max is exact, so the order does not change it).
          const bool full = _mm512_cmpge_epi32_mask(rel, _mm512_set1_epi32(jg)) == static_cast<__mmask16>(0xFFFF);
          if (full) {
            __m512 mc[4] = {mx, mx, mx, mx};
            for (int j = 0; j < jg; ++j) mc[j % 4] = _mm512_max_ps(mc[j % 4], _mm512_loadu_ps(Sb + j * L));
            mx = _mm512_max_ps(_mm512_max_ps(mc[0], mc[1]), _mm512_max_ps(mc[2], mc[3]));
          } else {
            for (int j = 0; j < jg; ++j)
              mx = _mm512_mask_max_ps(mx, _mm512_cmpgt_epi32_mask(rel, _mm512_set1_epi32(j)), mx, _mm512_loadu_ps(Sb + j * L));
          }
          alpha[bi] = _mm512_mask_blend_ps(any, one, exp512(_mm512_sub_ps(m_old, mx)));
          for (int j = 0; j < TN; ++j) {
            if (j < jg) {
              const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(Sb + j * L), mx));
              w[j] = full ? e : _mm512_maskz_mov_ps(_mm512_cmpgt_epi32_mask(rel, _mm512_set1_epi32(j)), e);
              _mm512_storeu_ps(Sb + j * L, w[j]);
            } else {
              w[j] = _mm512_setzero_ps();
              if (j < jmax) _mm512_storeu_ps(Sb + j * L, w[j]);  // keys only the block's other groups see
            }
          }
          // the tile's sum in tree_sum32's order
          for (int j = 0; j < 16; ++j) w[j] = _mm512_add_ps(w[j], w[j + 16]);
          for (int j = 0; j < 8; ++j) w[j] = _mm512_add_ps(w[j], w[j + 8]);
          for (int j = 0; j < 4; ++j) w[j] = _mm512_add_ps(w[j], w[j + 4]);
          for (int j = 0; j < 2; ++j) w[j] = _mm512_add_ps(w[j], w[j + 2]);
          const __m512 sum = _mm512_add_ps(w[0], w[1]);
          _mm512_storeu_ps(lp, _mm512_mask_blend_ps(any, _mm512_loadu_ps(lp), _mm512_fmadd_ps(_mm512_loadu_ps(lp), alpha[bi], sum)));
          _mm512_storeu_ps(mp, _mm512_mask_blend_ps(any, m_old, mx));
        }
        // acc = acc * alpha + P.V for the block's groups at once
        values_groups<D>(nb, walk.vrow, jmax, S, alpha, at);
      }
    }
  }
  for (int hi = 0; hi < nh; ++hi) {
    for (int r = 0; r < R; ++r) {
      const int64_t gi = hi * groups + r / L, i = r % L, row = static_cast<int64_t>(hi) * R + r;
      const float* at = At + gi * group_floats + i;
      float* acc = acc_all + row * D;
      for (int d = 0; d < D; ++d) acc[d] = at[d * L];
      m_all[row] = Mv[gi * L + i];
      l_all[row] = Lv[gi * L + i];
    }
  }
}
#endif

// a * b + c in one rounding where the CPU has FMA, else two: written out, so that every loop that
// computes a score does the same arithmetic whatever the compiler chooses to contract.
inline float madd(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
#define KVBUS_AVX2 1
// In-register 8 x 8 transpose: r[i] holds row i on entry, column i on exit.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#endif

// Kt [head_dim, TILE] from the tile's n key rows (zero past n).
inline void transpose_tile(const float* const* krow, int n, int head_dim, float* Kt) {
#if defined(KVBUS_AVX2)
  if (head_dim % 8 == 0) {
    for (int jb = 0; jb < TILE; jb += 8) {
      for (int d0 = 0; d0 < head_dim; d0 += 8) {
        __m256 blk[8];
        for (int j = 0; j < 8; ++j) blk[j] = jb + j < n ? _mm256_loadu_ps(krow[jb + j] + d0) : _mm256_setzero_ps();
        transpose8(blk);
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(Kt + (d0 + i) * TILE + jb, blk[i]);
      }
    }
    return;
  }
#endif
  for (int d = 0; d < head_dim; ++d) {
    for (int j = 0; j < n; ++j) Kt[d * TILE + j] = krow[j][d];
    for (int j = n; j < TILE; ++j) Kt[d * TILE + j] = 0.f;
  }
}

// S[r, j] = Q[r] . K[j] for the R rows from the transposed tile: for every (row, key) one chain
// of multiply-adds over d = 0, 1, ..., in that order, whether the row goes in a block of four
// (the same Kt loads serve four rows) or alone.
inline void tile_scores(const float* Q, int R, int head_dim, const float* Kt, float* S) {
  int r = 0;
#if defined(KVBUS_AVX2)
  static_assert(TILE == 16, "two 8-lane vectors per row");
  for (; r + 4 <= R; r += 4) {
    __m256 s0a = _mm256_setzero_ps(), s0b = s0a, s1a = s0a, s1b = s0a, s2a = s0a, s2b = s0a, s3a = s0a, s3b = s0a;
    const float* q0 = Q + static_cast<int64_t>(r) * head_dim;
    for (int d = 0; d < head_dim; ++d) {
      const __m256 ka = _mm256_loadu_ps(Kt + d * TILE), kb = _mm256_loadu_ps(Kt + d * TILE + 8);
      __m256 q = _mm256_broadcast_ss(q0 + d);
      s0a = _mm256_fmadd_ps(q, ka, s0a), s0b = _mm256_fmadd_ps(q, kb, s0b);
      q = _mm256_broadcast_ss(q0 + head_dim + d);
      s1a = _mm256_fmadd_ps(q, ka, s1a), s1b = _mm256_fmadd_ps(q, kb, s1b);
      q = _mm256_broadcast_ss(q0 + 2 * head_dim + d);
      s2a = _mm256_fmadd_ps(q, ka, s2a), s2b = _mm256_fmadd_ps(q, kb, s2b);
      q = _mm256_broadcast_ss(q0 + 3 * head_dim + d);
      s3a = _mm256_fmadd_ps(q, ka, s3a), s3b = _mm256_fmadd_ps(q, kb, s3b);
    }
    float* srow = S + r * TILE;
    _mm256_storeu_ps(srow, s0a), _mm256_storeu_ps(srow + 8, s0b);
    _mm256_storeu_ps(srow + TILE, s1a), _mm256_storeu_ps(srow + TILE + 8, s1b);
    _mm256_storeu_ps(srow + 2 * TILE, s2a), _mm256_storeu_ps(srow + 2 * TILE + 8, s2b);
    _mm256_storeu_ps(srow + 3 * TILE, s3a), _mm256_storeu_ps(srow + 3 * TILE + 8, s3b);
  }
  for (; r < R; ++r) {
    __m256 sa = _mm256_setzero_ps(), sb = sa;
    const float* q0 = Q + static_cast<int64_t>(r) * head_dim;
    for (int d = 0; d < head_dim; ++d) {
      const __m256 q = _mm256_broadcast_ss(q0 + d);
      sa = _mm256_fmadd_ps(q, _mm256_loadu_ps(Kt + d * TILE), sa);
      sb = _mm256_fmadd_ps(q, _mm256_loadu_ps(Kt + d * TILE + 8), sb);
    }
    _mm256_storeu_ps(S + r * TILE, sa), _mm256_storeu_ps(S + r * TILE + 8, sb);
  }
#else
  for (; r < R; ++r) {
    float s0[TILE] = {0};
    const float* q0 = Q + static_cast<int64_t>(r) * head_dim;
    for (int d = 0; d < head_dim; ++d) {
      const float a0 = q0[d];
      const float* kt = Kt + d * TILE;
#pragma omp simd
      for (int j = 0; j < TILE; ++j) s0[j] = madd(a0, kt[j], s0[j]);
    }
    std::memcpy(S + r * TILE, s0, sizeof(s0));
  }
#endif
}

// One task: rows [row0, row0 + num_tokens) of sequence b (their positions prefix + i), KV head
// h, KV tokens [k0, k1). Q holds the R = num_tokens * group query rows (token-major, already
// scaled). acc / m / l receive the unnormalized result.
// The path of every CPU without AVX-512 (and of head sizes other than 64 and 128 with it).
// NOTE: a row's arithmetic must not depend on R (decode: R = group; an extend's last block: a
// few tokens; a prefill block: 32 tokens): one score path for every R (a dot-product path for
// small R once summed d in another order, and a prompt's last token got other bits from an
// extend than from a cold prefill), the same softmax and P.V loops for every row.
template <typename KV, int D>
void attend(const Params& p, int b, int h, const float* Q, const int* limits, int R, int k0, int k1,
            float* acc, float* m, float* l, float* scratch) {
  const int head_dim = D > 0 ? D : p.head_dim;
  float* K = scratch;                    // [TILE, D]
  float* V = K + TILE * head_dim;        // [TILE, D]
  float* Kt = V + TILE * head_dim;       // [D, TILE]
  float* S = Kt + TILE * head_dim;       // [R, TILE]
  const KV* kc = reinterpret_cast<const KV*>(p.k_base);
  const KV* vc = reinterpret_cast<const KV*>(p.v_base);
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.bt_stride;
  for (int r = 0; r < R; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::fill(acc, acc + static_cast<int64_t>(R) * head_dim, 0.f);
  // Walk pages without a division per token: (page index, slot) of token k0.
  int page_idx = k0 / p.page_size, slot = k0 % p.page_size;
  const float* krow[TILE];
  const float* vrow[TILE];
  for (int t0 = k0; t0 < k1; t0 += TILE) {
    const int n = std::min(TILE, k1 - t0);
    for (int j = 0; j < n; ++j) {
      const int64_t page = table[page_idx];
      const KV* ks = kc + page * p.k_stride_page + slot * p.k_stride_tok + h * p.k_stride_head;
      const KV* vs = vc + page * p.v_stride_page + slot * p.v_stride_tok + h * p.v_stride_head;
      if constexpr (std::is_same_v<KV, float>) {  // read in place
        krow[j] = ks;
        vrow[j] = vs;
      } else {  // convert once per tile
        load_row(ks, K + j * head_dim, head_dim);
        load_row(vs, V + j * head_dim, head_dim);
        krow[j] = K + j * head_dim;
        vrow[j] = V + j * head_dim;
      }
      if (++slot == p.page_size) slot = 0, ++page_idx;
    }
    transpose_tile(krow, n, head_dim, Kt);
    tile_scores(Q, R, head_dim, Kt, S);
    // online softmax and P.V, row by row; row r sees tokens < limits[r]
    for (int r = 0; r < R; ++r) {
      const int visible = std::min(n, limits[r] - t0);
      if (visible <= 0) continue;
      float* s = S + r * TILE;
      float mx = m[r];
      for (int j = 0; j < visible; ++j) mx = std::max(mx, s[j]);
      const float alpha = exp_nonpos(m[r] - mx);
      float pj[TILE];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < TILE; ++j) {
        const float e = exp_nonpos(s[j] - mx);
        pj[j] = j < visible ? e : 0.f;
        sum += pj[j];
      }
      l[r] = madd(l[r], alpha, sum);
      m[r] = mx;
      float* a = acc + static_cast<int64_t>(r) * head_dim;
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) a[d] *= alpha;
      for (int j = 0; j < visible; ++j) {
        const float w = pj[j];
        const float* v = vrow[j];
#pragma omp simd
        for (int d = 0; d < head_dim; ++d) a[d] = madd(w, v[d], a[d]);
      }
    }
  }
}


// Heads h0 .. h0 + nh - 1 of one task (rows head after head, R each).
// NOTE: one path per head size, whatever the number of rows, so a row's arithmetic never
// depends on how many rows share its task (a prompt's last token gives the same logits
// whether its prefix was cached or not).
template <typename KV, int D>
void attend_heads(const Params& p, int b, int h0, int nh, const float* Q, const int* limits, int R, int k0, int k1,
                  float* acc, float* m, float* l, float* scratch) {
#if defined(KVBUS_AVX512)
  if constexpr (D == 64 || D == 128) {
    if (R >= LANES)
      attend_lanes<KV, D>(p, b, h0, nh, Q, limits, R, k0, k1, acc, m, l, scratch);
    else
      attend_wide<KV, D>(p, b, h0, nh, Q, limits, R, k0, k1, acc, m, l, scratch);
    return;
  }
#endif
  const int head_dim = D > 0 ? D : p.head_dim;
  for (int hi = 0; hi < nh; ++hi) {
    const int64_t off = static_cast<int64_t>(hi) * R;
    attend<KV, D>(p, b, h0 + hi, Q + off * head_dim, limits, R, k0, k1, acc + off * head_dim, m + off, l + off,
                  scratch);
  }
}

struct Task {
  int b, h0, nh, tok0, num_tokens, k0, k1, split, num_splits;
  int64_t partial;  // index of this task's partial slot; -1 when not split
};

template <typename Q_T, typename KV, int D>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
         const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, double scale, const float* k_scale,
         const float* v_scale, int64_t k_scale_stride, int64_t v_scale_stride, at::Tensor& out) {
  const int64_t B = seq_lens.size(0);
  const int Hq = q.size(1), head_dim = q.size(2);
  Params p;
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.bt_stride = block_tables.stride(0);
  p.k_base = static_cast<const char*>(k_cache.data_ptr());
  p.v_base = static_cast<const char*>(v_cache.data_ptr());
  p.k_stride_page = k_cache.stride(0), p.k_stride_tok = k_cache.stride(1), p.k_stride_head = k_cache.stride(2);
  p.v_stride_page = v_cache.stride(0), p.v_stride_tok = v_cache.stride(1), p.v_stride_head = v_cache.stride(2);
  p.page_size = k_cache.size(1), p.num_kv_heads = k_cache.size(2), p.head_dim = head_dim;
  p.group = Hq / p.num_kv_heads;
  const bool is_decode = cu_seqlens_q.numel() == 0;
  const int32_t* cu = is_decode ? nullptr : cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();

  // Tasks without splits first, then decide how far to split the KV ranges so that every
  // thread gets several tasks (decode of a few long sequences would otherwise use B * Hkv).
  struct Unit { int b, tok0, num_tokens, kv_len; };
  std::vector<Unit> units;
  const int64_t num_pages = k_cache.size(0), table_width = block_tables.size(1);
  TORCH_CHECK(is_decode || (cu[0] == 0 && cu[B] == q.size(0)), "kvbus: cu_seqlens_q must run from 0 to T=", q.size(0));
  for (int64_t b = 0; b < B; ++b) {
    const int q_begin = is_decode ? b : cu[b];
    const int q_len = is_decode ? 1 : cu[b + 1] - cu[b];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[b] && lens[b] >= (is_decode ? 1 : 0),
                "kvbus: sequence ", b, " has ", q_len, " new tokens but seq_len ", lens[b]);
    const int64_t need = (static_cast<int64_t>(lens[b]) + p.page_size - 1) / p.page_size;
    TORCH_CHECK(need <= table_width, "kvbus: seq_lens need ", need, " pages but block_tables has ", table_width);
    const int32_t* row = p.block_tables + b * p.bt_stride;
    for (int64_t i = 0; i < need; ++i)
      TORCH_CHECK(row[i] >= 0 && row[i] < num_pages, "kvbus: block_tables hold page ids outside [0, ", num_pages, ")");
    const int prefix = lens[b] - q_len;
    for (int i = 0; i < q_len; i += BLOCK_M) {
      const int nt = std::min(BLOCK_M, q_len - i);
      units.push_back({static_cast<int>(b), q_begin + i, nt, prefix + i + nt});
    }
  }
  const int threads = std::max(1, at::get_num_threads());
  // A task takes every KV head of its rows (a page's K and V are read once, in order) unless
  // there are too few units to keep every thread busy; then the heads are split into groups.
  const int64_t num_units0 = static_cast<int64_t>(units.size());
  const int head_groups = static_cast<int>(std::min<int64_t>(
      p.num_kv_heads, num_units0 >= 2 * threads ? 1 : (2 * threads + num_units0 - 1) / std::max<int64_t>(1, num_units0)));
  const int heads_per_group = (p.num_kv_heads + head_groups - 1) / head_groups;
  const int64_t num_units = num_units0 * head_groups;
  // Only decode splits: a prefill row's result must not depend on the batch (see attend_heads).
  const int64_t want_splits =
      !is_decode || num_units >= 4 * threads ? 1 : (4 * threads + num_units - 1) / num_units;
  std::vector<Task> tasks;
  int64_t num_partials = 0;
  for (const Unit& u : units) {
    const int64_t max_splits = std::max<int64_t>(1, u.kv_len / SPLIT_TOKENS);
    const int splits = static_cast<int>(std::min(want_splits, max_splits));
    // split boundaries on tile multiples
    const int tiles = (u.kv_len + TILE - 1) / TILE;
    for (int h0 = 0; h0 < p.num_kv_heads; h0 += heads_per_group) {
      const int nh = std::min(heads_per_group, p.num_kv_heads - h0);
      for (int s = 0; s < splits; ++s) {
        const int k0 = static_cast<int>(static_cast<int64_t>(tiles) * s / splits) * TILE;
        const int k1 = std::min(u.kv_len, static_cast<int>(static_cast<int64_t>(tiles) * (s + 1) / splits) * TILE);
        tasks.push_back({u.b, h0, nh, u.tok0, u.num_tokens, k0, k1, s, splits, splits > 1 ? num_partials++ : -1});
      }
    }
  }
  // Longest tasks first: dynamic hand-out then balances the causal prefill's uneven rows.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
    return static_cast<int64_t>(a.k1 - a.k0) * a.num_tokens * a.nh > static_cast<int64_t>(b.k1 - b.k0) * b.num_tokens * b.nh;
  });

  const int G = p.group;
  const int max_rows = BLOCK_M * G * heads_per_group;
  const int64_t row_floats = static_cast<int64_t>(max_rows) * head_dim;
  // the tile scratch of either path: the row path's 3 x 32 x D + R x 32; the lanes path's
  // 2 x 32 x D + GROUPS_MAX x 32 x 16 + D, then Q and acc transposed (2 x D per padded row), m and l, limits
  const int64_t padded_rows = static_cast<int64_t>(heads_per_group) * ((BLOCK_M * G + 15) / 16 * 16);
  const int64_t scratch_floats = std::max<int64_t>(3 * 32 * head_dim + max_rows * 32,
                                                   2 * 32 * head_dim + 2 * 32 * 16 + head_dim + padded_rows * (2 * head_dim + 3)) + 64;
  // partials: per split task, R rows of (acc[D], m, l)
  std::vector<float> partial(static_cast<size_t>(num_partials) * max_rows * (head_dim + 2));
  const Q_T* qp = q.data_ptr<Q_T>();
  Q_T* op = out.data_ptr<Q_T>();
  const int64_t q_st = q.stride(0), q_sh = q.stride(1);
  const int64_t o_st = out.stride(0), o_sh = out.stride(1);
  std::atomic<int64_t> next{0};
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());

  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // Q, acc, m, l, limits, then the tile scratch
    std::vector<float> buf(row_floats * 2 + max_rows * (2 + BLOCK_M) + scratch_floats);
    float* Q = buf.data();
    float* acc = Q + row_floats;
    float* m = acc + row_floats;
    float* l = m + max_rows;
    int* limits = reinterpret_cast<int*>(l + max_rows);
    float* scratch = reinterpret_cast<float*>(limits + max_rows);
    for (int64_t ti; (ti = next.fetch_add(1)) < num_tasks;) {
      const Task& t = tasks[ti];
      const int R = t.num_tokens * G;  // rows per head; the task holds t.nh heads' rows
      const int q_len = is_decode ? 1 : cu[t.b + 1] - cu[t.b];
      const int q_begin = is_decode ? t.b : cu[t.b];
      const int prefix = lens[t.b] - q_len;
      for (int hi = 0; hi < t.nh; ++hi) {
        const int h = t.h0 + hi;
        const float qs = static_cast<float>(scale) * (k_scale ? k_scale[h * k_scale_stride] : 1.f);
        for (int i = 0; i < t.num_tokens; ++i) {
          const int64_t tok = t.tok0 + i;
          for (int g = 0; g < G; ++g) {
            const int r = hi * R + i * G + g;
            const Q_T* src = qp + tok * q_st + (h * G + g) * q_sh;
            for (int d = 0; d < head_dim; ++d) Q[r * head_dim + d] = static_cast<float>(src[d]) * qs;
            limits[i * G + g] = std::min<int>(t.k1, prefix + static_cast<int>(tok - q_begin) + 1);
          }
        }
      }
      attend_heads<KV, D>(p, t.b, t.h0, t.nh, Q, limits, R, t.k0, t.k1, acc, m, l, scratch);
      if (t.partial < 0) {
        for (int r = 0; r < t.nh * R; ++r) {
          const int h = t.h0 + r / R, rr = r % R;
          const float vs = v_scale ? v_scale[h * v_scale_stride] : 1.f;
          const int64_t tok = t.tok0 + rr / G;
          Q_T* dst = op + tok * o_st + (h * G + rr % G) * o_sh;
          const float inv = vs / l[r];
          for (int d = 0; d < head_dim; ++d) dst[d] = static_cast<Q_T>(acc[r * head_dim + d] * inv);
        }
      } else {
        float* slot = partial.data() + t.partial * max_rows * (head_dim + 2);
        for (int r = 0; r < t.nh * R; ++r) {
          float* row = slot + r * (head_dim + 2);
          std::memcpy(row, acc + r * head_dim, sizeof(float) * head_dim);
          row[head_dim] = m[r];
          row[head_dim + 1] = l[r];
        }
      }
    }
  });
  if (num_partials == 0) return;
  // Merge the splits of each (unit, head): out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M).
  std::vector<const Task*> firsts;
  for (const Task& t : tasks)
    if (t.num_splits > 1 && t.split == 0) firsts.push_back(&t);
  at::parallel_for(0, static_cast<int64_t>(firsts.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t f = begin; f < end; ++f) {
      const Task& t0 = *firsts[f];
      const int R = t0.num_tokens * G;
      for (int r = 0; r < t0.nh * R; ++r) {
        const int h = t0.h0 + r / R, rr = r % R;
        const float vs = v_scale ? v_scale[h * v_scale_stride] : 1.f;
        float M = -std::numeric_limits<float>::infinity();
        for (int s = 0; s < t0.num_splits; ++s) {
          const float* row = partial.data() + (t0.partial + s) * max_rows * (head_dim + 2) + r * (head_dim + 2);
          if (row[head_dim + 1] > 0.f) M = std::max(M, row[head_dim]);
        }
        float L = 0.f;
        float o[512];
        std::fill(o, o + head_dim, 0.f);
        for (int s = 0; s < t0.num_splits; ++s) {
          const float* row = partial.data() + (t0.partial + s) * max_rows * (head_dim + 2) + r * (head_dim + 2);
          if (!(row[head_dim + 1] > 0.f)) continue;  // a split this row sees nothing of
          const float w = exp_nonpos(row[head_dim] - M);
          L += row[head_dim + 1] * w;
          for (int d = 0; d < head_dim; ++d) o[d] += row[d] * w;
        }
        const int64_t tok = t0.tok0 + rr / G;
        Q_T* dst = op + tok * o_st + (h * G + rr % G) * o_sh;
        const float inv = vs / L;
        for (int d = 0; d < head_dim; ++d) dst[d] = static_cast<Q_T>(o[d] * inv);
      }
    }
  });
}

template <typename Q_T, typename KV>
void run_d(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bt, const at::Tensor& cu,
           const at::Tensor& lens, double scale, const float* ks, const float* vs, int64_t kss, int64_t vss, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return run<Q_T, KV, 64>(q, k, v, bt, cu, lens, scale, ks, vs, kss, vss, out);
    case 128: return run<Q_T, KV, 128>(q, k, v, bt, cu, lens, scale, ks, vs, kss, vss, out);
    default: return run<Q_T, KV, 0>(q, k, v, bt, cu, lens, scale, ks, vs, kss, vss, out);
  }
}

template <typename Q_T>
void run_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bt, const at::Tensor& cu,
            const at::Tensor& lens, double scale, const float* ks, const float* vs, int64_t kss, int64_t vss, at::Tensor& out) {
  switch (k.scalar_type()) {
    case at::kFloat: return run_d<Q_T, float>(q, k, v, bt, cu, lens, scale, ks, vs, kss, vss, out);
    case at::kBFloat16: return run_d<Q_T, c10::BFloat16>(q, k, v, bt, cu, lens, scale, ks, vs, kss, vss, out);
    case at::kFloat8_e4m3fn: return run_d<Q_T, c10::Float8_e4m3fn>(q, k, v, bt, cu, lens, scale, ks, vs, kss, vss, out);
    default: TORCH_CHECK(false, "paged_attention: unsupported KV dtype ", k.scalar_type());
  }
}

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                     double scale, const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                     at::Tensor& out) {
  // Shapes, dtypes and page ids are checked by the Python launcher (kernels/attention_cpu.py).
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_attention: the head dimension must be contiguous");
  TORCH_CHECK(q.size(2) <= 512, "paged_attention: head_dim > 512");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  (cu_seqlens_q.numel() == 0 || cu_seqlens_q.scalar_type() == at::kInt),
              "paged_attention: int32 tables");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const float* ks = fp8 && k_scale ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = fp8 && v_scale ? v_scale->data_ptr<float>() : nullptr;
  const int64_t kss = ks && k_scale->dim() == 1 ? 1 : 0;
  const int64_t vss = vs && v_scale->dim() == 1 ? 1 : 0;
  if (q.scalar_type() == at::kFloat)
    run_kv<float>(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, ks, vs, kss, vss, out);
  else if (q.scalar_type() == at::kBFloat16)
    run_kv<c10::BFloat16>(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, ks, vs, kss, vss, out);
  else
    TORCH_CHECK(false, "paged_attention: q must be float32 or bfloat16, got ", q.scalar_type());
}

}  // namespace

namespace ops {
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                     double scale, const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                     at::Tensor& out) {
  kvbus_cpu::paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale, v_scale, out);
}
}  // namespace ops

TORCH_LIBRARY(kvbus_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q, "
      "Tensor seq_lens, float scale, Tensor? k_scale, Tensor? v_scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvbus_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }

}  // namespace kvbus_cpu
