// Every decoder layer of a decode-only step in one call.
//
//   decode_layers(h, input_norm[], post_norm[], qkv[], qkv_bias[], o[], o_bias[], gate_up[],
//                 gate_up_bias[], down[], down_bias[], k_caches[], v_caches[], positions, cos_sin,
//                 slot_mapping, block_tables, cu_seqlens_q, seq_lens, scale, eps, num_heads, num_kv_heads,
//                 intermediate)
//       -> (h, residual)
//
//   h            [T, H] float32, the embedded tokens (T <= the packed GEMM's rows: one per sequence)
//   *_norm[l]    [H] float32;  qkv[l], o[l], gate_up[l], down[l]: packed weights, float32
//                [ceil(N/16), K, 16] or bfloat16 [ceil(N/16), ceil(K/2), 32] (packed_gemm.cpp)
//   *_bias[l]    [N] float32, or an empty tensor for none
//   k/v_caches[l] [num_pages, page_size, Hkv, D] float32 or bfloat16 (written: this step's K and V,
//                rounded to bfloat16 for a bfloat16 cache)
//   positions, slot_mapping [T] int64; block_tables [B, max_pages] int32; seq_lens [B] int32
//   cu_seqlens_q  empty: one row per sequence (B = T); else [B + 1] int32: sequence b's rows (its last
//                token and the drafts it verifies) are rows cu[b] .. cu[b+1] - 1, attended as one
//                extend (paged_attention reads the sequence's KV once for all of them)
//   returns the last layer's output and the residual stream, for the final norm
//
// A decode step of a small model is a few hundred small ops; from Python each costs a dispatch,
// a shape check and a launcher (~15-20 us), which at one row is a quarter of the step (the step
// split in docs/benchmarks.md). Here the same kernels run in the same order on the same values as
// the per-op path of services/engine/llama.py (rms_norm, packed_gemm, rotary, store_kv,
// paged_attention, silu_and_mul), so every output is bit-identical to it (with float32 weights: with
// bfloat16 ones the loop keeps bfloat16 activations where this keeps float32); only the trips through
// Python are gone. Each kernel keeps its own checks. Under the torch profiler each kernel still
// shows under its op's name (RECORD_FUNCTION), so profiles split the step as before.

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace kvbus_cpu {
namespace {

std::optional<at::Tensor> bias_of(const at::Tensor& b) {
  return b.numel() ? std::optional<at::Tensor>(b) : std::nullopt;
}

#define KVBUS_SCOPE(name) RECORD_FUNCTION(name, std::vector<c10::IValue>())

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& h0, at::TensorList input_norm, at::TensorList post_norm, at::TensorList qkv,
    at::TensorList qkv_bias, at::TensorList o, at::TensorList o_bias, at::TensorList gate_up,
    at::TensorList gate_up_bias, at::TensorList down, at::TensorList down_bias, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& positions, const at::Tensor& cos_sin, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, double scale, double eps, int64_t num_heads,
    int64_t num_kv_heads, int64_t intermediate) {
  const size_t L = input_norm.size();
  TORCH_CHECK(L > 0 && post_norm.size() == L && qkv.size() == L && qkv_bias.size() == L && o.size() == L &&
                  o_bias.size() == L && gate_up.size() == L && gate_up_bias.size() == L && down.size() == L &&
                  down_bias.size() == L && k_caches.size() == L && v_caches.size() == L,
              "kvbus: decode_layers needs one of every weight, bias and cache per layer");
  TORCH_CHECK(h0.dim() == 2 && h0.scalar_type() == at::kFloat && h0.stride(1) == 1, "kvbus: decode_layers h [T, H]");
  TORCH_CHECK(k_caches[0].dim() == 4 && num_heads > 0 && num_kv_heads > 0, "kvbus: decode_layers shapes");
  const int64_t T = h0.size(0), H = h0.size(1), D = k_caches[0].size(3);
  const int64_t qs = num_heads * D, kvs = num_kv_heads * D;
  const int64_t inter = intermediate;
  const auto f32 = h0.options();
  at::Tensor x = at::empty({T, H}, f32);
  at::Tensor residual = h0.clone();
  at::Tensor h = at::empty({T, H}, f32);
  at::Tensor qkv_out = at::empty({T, qs + 2 * kvs}, f32);
  at::Tensor q_rot = at::empty({T, num_heads, D}, f32);
  at::Tensor k_rot = at::empty({T, num_kv_heads, D}, f32);
  at::Tensor attn = at::empty({T, num_heads, D}, f32);
  at::Tensor gu = at::empty({T, 2 * inter}, f32);
  at::Tensor act = at::empty({T, inter}, f32);
  const at::Tensor q = qkv_out.narrow(1, 0, qs).view({T, num_heads, D});
  const at::Tensor k = qkv_out.narrow(1, qs, kvs).view({T, num_kv_heads, D});
  const at::Tensor v = qkv_out.narrow(1, qs + kvs, kvs).view({T, num_kv_heads, D});
  const at::Tensor attn_rows = attn.view({T, qs});
  for (size_t l = 0; l < L; ++l) {
    {
      KVBUS_SCOPE("kvbus_cpu::rms_norm");
      if (l == 0)  // no residual yet: the embedding is the residual (kept in `residual`)
        ops::rms_norm(h0, input_norm[0], std::nullopt, eps, x, x);
      else  // residual += h, in place (the kernel reads each element before it writes it)
        ops::rms_norm(h, input_norm[l], residual, eps, x, residual);
    }
    {
      KVBUS_SCOPE("kvbus_cpu::packed_gemm");
      ops::packed_gemm(x, qkv[l], bias_of(qkv_bias[l]), qkv_out);
    }
    {
      KVBUS_SCOPE("kvbus_cpu::rotary");
      ops::rotary(q, k, positions, cos_sin, q_rot, k_rot);
    }
    {
      KVBUS_SCOPE("kvbus_cpu::store_kv");
      at::Tensor kc = k_caches[l], vc = v_caches[l];
      ops::store_kv(k_rot, v, kc, vc, slot_mapping);
    }
    {
      KVBUS_SCOPE("kvbus_cpu::paged_attention");
      ops::paged_attention(q_rot, k_caches[l], v_caches[l], block_tables, cu_seqlens_q, seq_lens, scale, std::nullopt,
                           std::nullopt, attn);
    }
    {
      KVBUS_SCOPE("kvbus_cpu::packed_gemm");
      ops::packed_gemm(attn_rows, o[l], bias_of(o_bias[l]), h);
    }
    {
      KVBUS_SCOPE("kvbus_cpu::rms_norm");
      ops::rms_norm(h, post_norm[l], residual, eps, x, residual);
    }
    {
      KVBUS_SCOPE("kvbus_cpu::packed_gemm");
      ops::packed_gemm(x, gate_up[l], bias_of(gate_up_bias[l]), gu);
    }
    {
      KVBUS_SCOPE("kvbus_cpu::silu_and_mul");
      ops::silu_and_mul(gu, act);
    }
    {
      KVBUS_SCOPE("kvbus_cpu::packed_gemm");
      ops::packed_gemm(act, down[l], bias_of(down_bias[l]), h);
    }
  }
  return {h, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvbus_cpu, m) {
  m.def(
      "decode_layers(Tensor h, Tensor[] input_norm, Tensor[] post_norm, Tensor[] qkv, Tensor[] qkv_bias, "
      "Tensor[] o, Tensor[] o_bias, Tensor[] gate_up, Tensor[] gate_up_bias, Tensor[] down, Tensor[] down_bias, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor positions, Tensor cos_sin, Tensor slot_mapping, "
      "Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, float scale, float eps, int num_heads, int num_kv_heads, "
      "int intermediate) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvbus_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }

}  // namespace kvbus_cpu
