// Fused CPU kernels of the decode step (one token per sequence), built from source at start-up
// (ModelRunner.set_fast_kernels) by workers/model/kernels.py through torch's extension mechanism. Each kernel has a pure-torch
// reference beside it (the eager path), and the tests hold them equal.
//
// All caches are updated in place at the sequences' own slots / blocks: no gather of the
// running states into a batch and no scatter back, whatever the slot order.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// torch.nn.functional.softplus with beta = 1, threshold = 20.
inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

}  // namespace

// Causal depthwise conv of one new input per sequence, then SiLU.
//   conv_cache [S, C, K-1]  the last K-1 inputs of each slot, oldest first; shifted in place
//   slots [B], xbc [B, C], weight [C, K], bias [C] or empty  ->  out [B, C]
torch::Tensor conv_step(torch::Tensor conv_cache, torch::Tensor slots, torch::Tensor xbc, torch::Tensor weight,
                        torch::Tensor bias) {
  TORCH_CHECK(conv_cache.is_contiguous() && conv_cache.scalar_type() == torch::kFloat32);
  TORCH_CHECK(xbc.is_contiguous() && xbc.scalar_type() == torch::kFloat32);
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == torch::kFloat32);
  const int64_t batch = xbc.size(0), channels = xbc.size(1), width = weight.size(1), kept = width - 1;
  TORCH_CHECK(conv_cache.size(1) == channels && conv_cache.size(2) == kept);
  auto out = torch::empty_like(xbc);
  auto slot = slots.contiguous().to(torch::kLong);
  const int64_t* slot_p = slot.data_ptr<int64_t>();
  float* cache_p = conv_cache.data_ptr<float>();
  const float* x_p = xbc.data_ptr<float>();
  const float* w_p = weight.data_ptr<float>();
  const float* b_p = bias.numel() ? bias.contiguous().data_ptr<float>() : nullptr;
  float* out_p = out.data_ptr<float>();
  at::parallel_for(0, batch * channels, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / channels, c = i % channels;
      float* hist = cache_p + (slot_p[b] * channels + c) * kept;
      const float* w = w_p + c * width;
      const float x = x_p[i];
      float acc = b_p ? b_p[c] : 0.0f;
      for (int64_t k = 0; k < kept; ++k) acc += hist[k] * w[k];
      acc += x * w[kept];
      for (int64_t k = 0; k + 1 < kept; ++k) hist[k] = hist[k + 1];
      if (kept > 0) hist[kept - 1] = x;
      out_p[i] = silu(acc);
    }
  });
  return out;
}

// One step of the Mamba2 recurrence per sequence, in place in its slot, with the D skip:
//   dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max)
//   state <- exp(dt * A) * state + (dt * x) outer B;   y = state . C + D * x
//   ssm_cache [S, H, P, N], slots [B], x [B, H, P], dt_raw [B, H], B/C [B, G, N]  ->  y [B, H, P]
torch::Tensor ssm_step(torch::Tensor ssm_cache, torch::Tensor slots, torch::Tensor x, torch::Tensor dt_raw,
                       torch::Tensor dt_bias, torch::Tensor A, torch::Tensor Bm, torch::Tensor Cm, torch::Tensor D,
                       double dt_min, double dt_max) {
  for (const auto& t : {ssm_cache, x, dt_raw, dt_bias, A, Bm, Cm, D}) {
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat32, "ssm_step wants contiguous fp32");
  }
  const int64_t batch = x.size(0), heads = x.size(1), hdim = x.size(2);
  const int64_t groups = Bm.size(1), dstate = Bm.size(2), per_group = heads / groups;
  TORCH_CHECK(ssm_cache.size(1) == heads && ssm_cache.size(2) == hdim && ssm_cache.size(3) == dstate);
  auto y = torch::empty_like(x);
  auto slot = slots.contiguous().to(torch::kLong);
  const int64_t* slot_p = slot.data_ptr<int64_t>();
  float* cache_p = ssm_cache.data_ptr<float>();
  const float *x_p = x.data_ptr<float>(), *dt_p = dt_raw.data_ptr<float>(), *bias_p = dt_bias.data_ptr<float>();
  const float *a_p = A.data_ptr<float>(), *b_p = Bm.data_ptr<float>(), *c_p = Cm.data_ptr<float>();
  const float* d_p = D.data_ptr<float>();
  float* y_p = y.data_ptr<float>();
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads, g = h / per_group;
      const float dt = std::min(std::max(softplus(dt_p[i] + bias_p[h]), lo), hi);
      const float decay = std::exp(dt * a_p[h]);
      const float* Bv = b_p + (b * groups + g) * dstate;
      const float* Cv = c_p + (b * groups + g) * dstate;
      const float* xv = x_p + i * hdim;
      float* state = cache_p + (slot_p[b] * heads + h) * hdim * dstate;
      float* yv = y_p + i * hdim;
      for (int64_t p = 0; p < hdim; ++p) {
        float* row = state + p * dstate;
        const float dx = dt * xv[p];
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < dstate; ++n) {
          const float v = row[n] * decay + dx * Bv[n];
          row[n] = v;
          acc += v * Cv[n];
        }
        yv[p] = acc + d_p[h] * xv[p];
      }
    }
  });
  return y;
}

// Attention of one query token per sequence over its paged K/V, read in place by block table.
//   q [B, Hq, d]; k_cache/v_cache [num_blocks, block_size, Hkv, d]; block_tables [B, max_blocks];
//   num_keys [B] (keys 0..num_keys-1 are visible)  ->  out [B, Hq, d]
// Online softmax over the keys: one pass, nothing materialised per sequence.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor num_keys, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32);
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  const int64_t batch = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), per_kv = q_heads / kv_heads;
  auto tables = block_tables.contiguous().to(torch::kLong);
  auto lens = num_keys.contiguous().to(torch::kLong);
  auto out = torch::empty_like(q);
  const int64_t width = tables.size(1);
  const int64_t* table_p = tables.data_ptr<int64_t>();
  const int64_t* len_p = lens.data_ptr<int64_t>();
  const float *q_p = q.data_ptr<float>(), *k_p = k_cache.data_ptr<float>(), *v_p = v_cache.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t token_stride = kv_heads * dim;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(per_kv * dim), best(per_kv), total(per_kv), score(per_kv);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, kvh = i % kv_heads;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(best.begin(), best.end(), -std::numeric_limits<float>::infinity());
      std::fill(total.begin(), total.end(), 0.0f);
      const float* qb = q_p + (b * q_heads + kvh * per_kv) * dim;
      for (int64_t t = 0; t < len_p[b]; ++t) {
        const int64_t block = table_p[b * width + t / block_size];
        const int64_t offset = (block * block_size + t % block_size) * token_stride + kvh * dim;
        const float* key = k_p + offset;
        const float* value = v_p + offset;
        for (int64_t j = 0; j < per_kv; ++j) {
          const float* qv = qb + j * dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t e = 0; e < dim; ++e) dot += qv[e] * key[e];
          const float s = dot * sc;
          float* a = acc.data() + j * dim;
          if (s > best[j]) {  // rescale what was accumulated against the new maximum
            const float r = std::exp(best[j] - s);
            total[j] *= r;
            for (int64_t e = 0; e < dim; ++e) a[e] *= r;
            best[j] = s;
          }
          const float w = std::exp(s - best[j]);
          total[j] += w;
#pragma omp simd
          for (int64_t e = 0; e < dim; ++e) a[e] += w * value[e];
        }
      }
      for (int64_t j = 0; j < per_kv; ++j) {
        float* o = out_p + (b * q_heads + kvh * per_kv + j) * dim;
        const float inv = total[j] > 0.0f ? 1.0f / total[j] : 0.0f;
        for (int64_t e = 0; e < dim; ++e) o[e] = acc[j * dim + e] * inv;
      }
    }
  });
  return out;
}

// RMSNorm over the last dimension in one pass per row: weight * x / sqrt(mean(x^2) + eps).
// With `gate`, Mamba2's gated norm: x * silu(gate) first, normalised over groups of `group` channels.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> gate, int64_t group,
                       double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32);
  auto xc = x.contiguous();
  const int64_t width = xc.size(-1), rows = xc.numel() / width;
  TORCH_CHECK(width % group == 0 && weight.numel() == width);
  auto gc = gate.has_value() ? gate->contiguous() : torch::Tensor();
  TORCH_CHECK(!gc.defined() || (gc.scalar_type() == torch::kFloat32 && gc.numel() == xc.numel()));
  auto out = torch::empty_like(xc);
  const float *x_p = xc.data_ptr<float>(), *w_p = weight.contiguous().data_ptr<float>();
  const float* g_p = gc.defined() ? gc.data_ptr<float>() : nullptr;
  float* o_p = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows * (width / group), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t offset = i * group;
      float* o = o_p + offset;
      float ss = 0.0f;
      for (int64_t j = 0; j < group; ++j) {
        const float v = g_p ? x_p[offset + j] * silu(g_p[offset + j]) : x_p[offset + j];
        o[j] = v;
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(group) + e);
      const float* w = w_p + offset % width;
      for (int64_t j = 0; j < group; ++j) o[j] = w[j] * (o[j] * inv);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm (optionally gated, grouped) in one pass per row");
  m.def("conv_step", &conv_step, "Mamba2 decode conv step, in place by slot");
  m.def("ssm_step", &ssm_step, "Mamba2 decode recurrence step, in place by slot");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged K/V, read in place");
}
