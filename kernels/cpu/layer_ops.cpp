// The small per-layer ops of a step, fused and vectorized: writing K/V into the paged cache,
// rotary embedding of q and k, RMSNorm with its residual add, and SwiGLU's silu(gate) * up.
//
//   store_kv(k, v, k_cache, v_cache, slot_mapping)
//       k, v                [T, Hkv, D], D contiguous, same dtype as the caches (float32 | bfloat16),
//                           or float32 into bfloat16 caches (rounded to nearest even, as .to() does)
//       k_cache, v_cache    [num_pages, page_size, Hkv, D], any page/slot/head strides, D contiguous
//       slot_mapping        [T] int64: page_id * page_size + offset; negative = skip
//   rotary(q, k, positions, cos_sin, q_out, k_out)        (NeoX "rotate half", float32)
//       q [T, Hq, D], k [T, Hkv, D] (any token/head strides, D contiguous), positions [T] int64,
//       cos_sin [max_pos, D] float32 = (cos | sin) of the D/2 frequencies; outputs contiguous
//       out[:h] = x[:h] cos - x[h:] sin,  out[h:] = x[h:] cos + x[:h] sin   (h = D/2)
//   rms_norm(x, weight, residual?, eps, y, sum_out)         (float32)
//       x, residual [T, H] rows contiguous, weight [H]; s = x (+ residual), written to sum_out
//       when there is a residual; y = weight * s / sqrt(mean(s^2) + eps)
//   silu_and_mul(x, out)                                   (float32)
//       x [T, 2d] rows contiguous (gate | up), out [T, d] = silu(gate) * up
//
// The torch references (kernels/paged_store.py, rotary.py, activation.py) take 2-5 ops each per
// layer (index_put, index_select + 4 muls per tensor, silu + mul), every one a pass over memory
// and a dispatch; in a 1024-token prefill on the dev VM store_kv's index_put alone cost 4% of
// the step (1.5 ms a call for 0.8 MB). Each op here is one pass, row-parallel over torch's pool.
// Rows are independent, so a row's result never depends on the batch around it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "ops.h"
#include "vec_math.h"

namespace kvbus_cpu {
namespace {

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "kvbus: k, v must both be [T, Hkv, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "kvbus: k_cache, v_cache must both be [num_pages, page_size, Hkv, D]");
  TORCH_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2), "kvbus: k/v heads or head_dim differ from the cache's");
  const bool round = k.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k.scalar_type() == k_cache.scalar_type() || round),
              "kvbus: store_kv needs k, v and the caches in one dtype (or float32 k, v into bfloat16 caches)");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) && slot_mapping.scalar_type() == at::kLong,
              "kvbus: slot_mapping must be [T] int64");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "kvbus: store_kv needs a contiguous head dimension");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t page_size = k_cache.size(1), num_slots = k_cache.size(0) * page_size;
  const auto sm = slot_mapping.contiguous();
  const int64_t* slots = sm.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] < num_slots, "kvbus: slot_mapping holds slots past the cache (", num_slots, " slots)");
  const int64_t es = k.element_size(), ces = k_cache.element_size(), row = D * es;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  // one head row into its slot: a copy, or float32 rounded to bfloat16
  const auto put = [&](char* dst, const char* src) {
    if (!round) return static_cast<void>(std::memcpy(dst, src, row));
    const float* x = reinterpret_cast<const float*>(src);
    c10::BFloat16* y = reinterpret_cast<c10::BFloat16*>(dst);
    for (int64_t d = 0; d < D; ++d) y[d] = c10::BFloat16(x[d]);
  };
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      const int64_t page = s / page_size, off = s % page_size;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t src_k = (t * k.stride(0) + h * k.stride(1)) * es, src_v = (t * v.stride(0) + h * v.stride(1)) * es;
        put(kc + (page * k_cache.stride(0) + off * k_cache.stride(1) + h * k_cache.stride(2)) * ces, kp + src_k);
        put(vc + (page * v_cache.stride(0) + off * v_cache.stride(1) + h * v_cache.stride(2)) * ces, vp + src_v);
      }
    }
  });
}

// One head row of rotary: x [D] -> out [D] with cos/sin of its position.
inline void rotate_row(const float* x, const float* cos, const float* sin, float* out, int64_t half) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= half; i += 16) {
    const __m512 x1 = _mm512_loadu_ps(x + i), x2 = _mm512_loadu_ps(x + half + i);
    const __m512 c = _mm512_loadu_ps(cos + i), s = _mm512_loadu_ps(sin + i);
    _mm512_storeu_ps(out + i, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)));
    _mm512_storeu_ps(out + half + i, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)));
  }
#endif
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    out[i] = x1 * cos[i] - x2 * sin[i];
    out[half + i] = x2 * cos[i] + x1 * sin[i];
  }
}

void rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos_sin,
            at::Tensor& q_out, at::Tensor& k_out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "kvbus: rotary needs q [T, Hq, D] and k [T, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && cos_sin.scalar_type() == at::kFloat,
              "kvbus: rotary is float32");
  const int64_t T = q.size(0), Hq = q.size(1), Hk = k.size(1), D = q.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos_sin.dim() == 2 && cos_sin.size(1) == D && cos_sin.is_contiguous(),
              "kvbus: cos_sin must be [max_pos, D] contiguous");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.scalar_type() == at::kLong,
              "kvbus: positions must be [T] int64");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q_out.is_contiguous() && k_out.is_contiguous(),
              "kvbus: rotary needs a contiguous head dimension");
  const auto pc = positions.contiguous();
  const int64_t* pos = pc.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "kvbus: positions must be in [0, ", max_pos, ")");
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* cs = cos_sin.data_ptr<float>();
  float* qo = q_out.data_ptr<float>();
  float* ko = k_out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cs + pos[t] * D;
      for (int64_t h = 0; h < Hq; ++h)
        rotate_row(qp + t * q.stride(0) + h * q.stride(1), c, c + half, qo + (t * Hq + h) * D, half);
      for (int64_t h = 0; h < Hk; ++h)
        rotate_row(kp + t * k.stride(0) + h * k.stride(1), c, c + half, ko + (t * Hk + h) * D, half);
    }
  });
}

// silu(g) * u with sigmoid from exp of a non-positive argument only: e = exp(-|g|),
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below.
inline float silu_mul_one(float g, float u) {
  const float e = exp_nonpos(-std::fabs(g));
  const float sig = (g >= 0.f ? 1.f : e) / (1.f + e);
  return g * sig * u;
}

void silu_and_mul(const at::Tensor& x, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == x.size(1) / 2,
              "kvbus: silu_and_mul needs x [T, 2d] and out [T, d]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "kvbus: silu_and_mul is float32");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "kvbus: silu_and_mul needs contiguous rows");
  const int64_t T = x.size(0), d = out.size(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * xs;
      const float* u = g + d;
      float* o = op + t * os;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= d; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
        const __mmask16 pos = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_GE_OQ);
        const __m512 num = _mm512_mask_blend_ps(pos, e, one);
        const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(one, e));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + i)));
      }
#endif
      for (; i < d; ++i) o[i] = silu_mul_one(g[i], u[i]);
    }
  });
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& residual, double eps,
              at::Tensor& y, at::Tensor& sum_out) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1) && y.sizes() == x.sizes(),
              "kvbus: rms_norm needs x [T, H], weight [H], y [T, H]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "kvbus: rms_norm is float32");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous() && y.stride(1) == 1, "kvbus: rms_norm needs contiguous rows");
  const float* rp = nullptr;
  int64_t rs = 0, ss = 0;
  float* sp = nullptr;
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat && residual->stride(1) == 1 &&
                    sum_out.sizes() == x.sizes() && sum_out.stride(1) == 1,
                "kvbus: rms_norm residual and sum_out must match x");
    rp = residual->data_ptr<float>();
    rs = residual->stride(0);
    sp = sum_out.data_ptr<float>();
    ss = sum_out.stride(0);
  }
  const int64_t T = x.size(0), H = x.size(1), xs = x.stride(0), ys = y.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * xs;
      const float* src = xr;
      if (rp) {  // s = x + residual, kept for the next layer's residual
        const float* rr = rp + t * rs;
        float* sr = sp + t * ss;
        for (int64_t i = 0; i < H; ++i) sr[i] = xr[i] + rr[i];
        src = sr;
      }
      float sq = 0.f;
      int64_t i = 0;
#if defined(__AVX512F__)
      __m512 acc = _mm512_setzero_ps();
      for (; i + 16 <= H; i += 16) {
        const __m512 v = _mm512_loadu_ps(src + i);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      sq = _mm512_reduce_add_ps(acc);
#endif
      for (; i < H; ++i) sq += src[i] * src[i];
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(H) + static_cast<float>(eps));
      float* yr = yp + t * ys;
      for (i = 0; i < H; ++i) yr[i] = wp[i] * (src[i] * inv);
    }
  });
}

// The instruction-set path this build was compiled for (-march=native, so the build machine's):
// "avx512" (the AVX-512 attention and packed GEMM), "avx2" (their AVX2 + FMA versions) or "plain"
// (loops the compiler vectorizes as it can), then "+avx512_bf16" where bfloat16 packed GEMMs use
// vdpbf16ps. kernels/cpu_path.py reports it at start-up beside the CPU's flags.
std::string isa() {
#if defined(__AVX512F__)
  std::string s = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  std::string s = "avx2";
#else
  std::string s = "plain";
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  s += "+avx512_bf16";
#endif
  return s;
}

}  // namespace

namespace ops {
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  kvbus_cpu::store_kv(k, v, k_cache, v_cache, slot_mapping);
}
void rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos_sin,
            at::Tensor& q_out, at::Tensor& k_out) {
  kvbus_cpu::rotary(q, k, positions, cos_sin, q_out, k_out);
}
void silu_and_mul(const at::Tensor& x, at::Tensor& out) { kvbus_cpu::silu_and_mul(x, out); }
void rms_norm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& residual, double eps,
              at::Tensor& y, at::Tensor& sum_out) {
  kvbus_cpu::rms_norm(x, weight, residual, eps, y, sum_out);
}
}  // namespace ops

TORCH_LIBRARY_FRAGMENT(kvbus_cpu, m) {
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("rotary(Tensor q, Tensor k, Tensor positions, Tensor cos_sin, Tensor(a!) q_out, Tensor(b!) k_out) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, Tensor? residual, float eps, Tensor(a!) y, Tensor(b!) sum_out) -> ()");
  m.def("isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(kvbus_cpu, CPU, m) {
  m.impl("store_kv", &store_kv);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rms_norm", &rms_norm);
}

}  // namespace kvbus_cpu
