// The native ops' C++ entry points, for kernels that chain them (decode_stack.cpp) without a
// trip through Python and the dispatcher. Each is the op registered under the same name in
// TORCH_LIBRARY(kvbus_cpu): same arguments, same checks, same results. Defined in
// layer_ops.cpp, packed_gemm.cpp and paged_attention.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace kvbus_cpu {
namespace ops {

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping);
void rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos_sin,
            at::Tensor& q_out, at::Tensor& k_out);
void silu_and_mul(const at::Tensor& x, at::Tensor& out);
void rms_norm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& residual, double eps,
              at::Tensor& y, at::Tensor& sum_out);
void packed_gemm(const at::Tensor& x, const at::Tensor& wp, const std::optional<at::Tensor>& bias, at::Tensor& y);
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                     double scale, const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                     at::Tensor& out);

}  // namespace ops
}  // namespace kvbus_cpu
