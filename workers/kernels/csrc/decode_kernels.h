// What the sources of the decode module (decode_kernels.cpp, which binds the Python ops, and
// paged_attention.cpp) share beyond the vector math: the argument check and the attention op.
#pragma once

#include <torch/extension.h>

inline void check_fp32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, what, " must be float32");
}

// paged_attention.cpp
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor num_keys, double scale,
                                     c10::optional<torch::Tensor> k_new, c10::optional<torch::Tensor> v_new,
                                     c10::optional<torch::Tensor> kv_slots);
