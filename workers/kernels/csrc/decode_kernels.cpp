// Fused CPU kernels of the decode step (one token per sequence) and of the per-layer glue around
// the weight matmuls, built from source at start-up (ModelRunner.set_fast_kernels) by
// workers/kernels/extensions.py through torch's extension mechanism. Each kernel has a pure-torch
// reference beside it (the eager path), and the tests hold them equal.
//
// All caches are updated in place at the sequences' own slots / blocks: no gather of the
// running states into a batch and no scatter back, whatever the slot order.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "decode_kernels.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// One group of `n` channels normalised: out = weight * v / sqrt(mean(v^2) + eps), where
// v = x * silu(gate) with a gate, else x. `out` may alias `x`.
inline void normalise_group(const float* x, const float* gate, const float* weight, float* out, int64_t n, float eps) {
  if (gate) {  // v = x * silu(gate), into out (silu_row reads each vector of x before writing it there)
    silu_row(gate, x, out, n);
    x = out;
  }
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) ss += x[j] * x[j];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = weight[j] * (x[j] * inv);
}

// Work items per parallel task so that a task is worth a thread hand-off (~16k floats).
inline int64_t grain_for(int64_t floats_per_item) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, floats_per_item)); }

// Bytes ahead of the state row being stepped: 2 KB measured 5-8% faster than none at 8 and 32
// sequences (4 KB the same, 1 KB less); stepping 4 rows at once (4 FMA chains) measured slower.
constexpr int64_t kPrefetchAhead = 2048;

// a * b rounded on its own. The empty asm takes the product as a register value, so the compiler
// cannot contract it into the add that follows (-ffp-contract=fast is GCC's default).
inline float mul_unfused(float a, float b) {
  float product = a * b;
  asm("" : "+x"(product));
  return product;
}

// Flat channels [begin, end) of the batch (i = sequence * conv_dim + channel): the causal conv of
// each over [its kept inputs | the new input], its history shifted in place (before silu).
// KEPT = 0: the kept width `kept` at run time.
//
//   acc = bias;  acc = fma(kept[k], w[k], acc) for k = 0 .. K-2;  acc = acc + (x * w[K-1])
//
// the last product rounded on its own, as the loop this replaced compiled (its product sat outside
// the taps' loop): the same bits.
template <int64_t KEPT>
void conv_channels(
    const float* in, int64_t row_stride, int64_t inter, float* hist_all, int64_t conv_dim, int64_t kept_rt,
    const int64_t* slots, const float* w_all, const float* bias, float* out, int64_t begin, int64_t end) {
  const int64_t kept = KEPT ? KEPT : kept_rt, width = kept + 1;
  int64_t b = begin / conv_dim, c = begin % conv_dim;
  for (int64_t i = begin; i < end; ++i) {
    float* hist = hist_all + (slots[b] * conv_dim + c) * kept;
    const float* w = w_all + c * width;
    const float x = in[b * row_stride + inter + c];
    float acc = bias ? bias[c] : 0.0f;
    for (int64_t k = 0; k < kept; ++k) acc = fmadd(hist[k], w[k], acc);
    acc = acc + mul_unfused(x, w[kept]);
    for (int64_t k = 0; k + 1 < kept; ++k) hist[k] = hist[k + 1];
    if (kept > 0) hist[kept - 1] = x;
    out[i] = acc;
    if (++c == conv_dim) {
      c = 0;
      ++b;
    }
  }
}

// One head's state [P, N] stepped in place, one read and one write of each element, and y [P]:
//
//   row p:  dot = step_state_row(s[p], decay, dt * x[p], B, C)   (vector_math.h: s[p] updated)
//           y[p] = fma(D, x[p], dot)
//
// While row p is stepped, the lines kPrefetchAhead bytes on are prefetched; past the end of this
// head that is the start of `next` (the state this thread steps next, at any slot, or none), so
// the stream does not stall where the hardware prefetcher loses it (page and slot boundaries).
inline void step_head(float* state, const float* next, int64_t hdim, int64_t dstate, const float* x, const float* B,
                      const float* C, float dt, float decay, float d, float* y) {
  const int64_t row_bytes = dstate * static_cast<int64_t>(sizeof(float)), head_bytes = hdim * row_bytes;
  const char* here = reinterpret_cast<const char*>(state);
  const char* after = reinterpret_cast<const char*>(next);
  for (int64_t p = 0; p < hdim; ++p) {
    for (int64_t k = 0; k < row_bytes; k += kLine) {
      const int64_t ahead = p * row_bytes + kPrefetchAhead + k;
      if (ahead < head_bytes) {
        __builtin_prefetch(here + ahead, 1, 3);
      } else if (after) {
        __builtin_prefetch(after + (ahead - head_bytes), 1, 3);
      }
    }
    y[p] = fmadd(d, x[p], step_state_row(state + p * dstate, dstate, decay, dt * x[p], B, C));
  }
}

}  // namespace

// The Mamba2 decode step of one layer, after in_proj, in one call: conv, recurrence, D skip
// and (with `norm_weight`) the gated group norm. Reads the in_proj output row as it is:
//
//   zxbcdt [B, I + conv_dim + H]   row stride free, channels contiguous
//          | gate (I) | x (I) | B (G*N) | C (G*N) | dt (H) |
//                     \____ xBC: the conv's input _/
//
//   conv_cache [S, conv_dim, K-1] (oldest first; shifted in place), ssm_cache [S, H, P, N], slots [B]
//   conv:   xBC <- silu(bias + sum_k w[k] * window[k])  over [cache | new input]
//   ssm:    dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max)
//           state <- exp(dt * A) * state + (dt * x) outer B;   y = state . C + D * x
//   norm:   out = norm_weight * rmsnorm_group(y * silu(gate))   (skipped: out = y)
// -> out [B, I]
torch::Tensor mamba_decode(torch::Tensor zxbcdt, torch::Tensor conv_cache, torch::Tensor ssm_cache, torch::Tensor slots,
                           torch::Tensor conv_weight, torch::Tensor conv_bias, torch::Tensor dt_bias, torch::Tensor A,
                           torch::Tensor D, double dt_min, double dt_max, torch::Tensor norm_weight, int64_t norm_group,
                           double eps) {
  for (const auto& t : {zxbcdt, conv_cache, ssm_cache, conv_weight, dt_bias, A, D}) check_fp32(t, "mamba_decode input");
  TORCH_CHECK(conv_cache.is_contiguous() && ssm_cache.is_contiguous() && conv_weight.is_contiguous());
  TORCH_CHECK(zxbcdt.dim() == 2 && zxbcdt.stride(1) == 1, "zxbcdt must be [B, width] with contiguous channels");
  const int64_t batch = zxbcdt.size(0), row_stride = zxbcdt.stride(0);
  const int64_t heads = ssm_cache.size(1), hdim = ssm_cache.size(2), dstate = ssm_cache.size(3);
  const int64_t inter = heads * hdim, conv_dim = conv_weight.size(0), width = conv_weight.size(1), kept = width - 1;
  const int64_t groups = (conv_dim - inter) / (2 * dstate), per_group = heads / groups;
  TORCH_CHECK(zxbcdt.size(1) == inter + conv_dim + heads, "zxbcdt width does not match the caches");
  TORCH_CHECK(conv_cache.size(1) == conv_dim && conv_cache.size(2) == kept && slots.size(0) == batch);
  const bool norm = norm_weight.numel() > 0;
  TORCH_CHECK(!norm || (norm_weight.numel() == inter && inter % norm_group == 0));

  auto slot = slots.contiguous().to(torch::kLong);
  auto xconv = torch::empty({batch, conv_dim}, zxbcdt.options());
  auto out = torch::empty({batch, inter}, zxbcdt.options());
  auto bias = conv_bias.numel() ? conv_bias.contiguous() : conv_bias;
  auto wnorm = norm ? norm_weight.contiguous() : norm_weight;
  const int64_t* slot_p = slot.data_ptr<int64_t>();
  const float* in_p = zxbcdt.data_ptr<float>();
  float* conv_p = conv_cache.data_ptr<float>();
  float* ssm_p = ssm_cache.data_ptr<float>();
  const float* w_p = conv_weight.data_ptr<float>();
  const float* b_p = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const float *dtb_p = dt_bias.data_ptr<float>(), *a_p = A.data_ptr<float>(), *d_p = D.data_ptr<float>();
  float* xc_p = xconv.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max), e = static_cast<float>(eps);

  // 1. conv of every channel, its history shifted in place, then silu: both threads from ~2
  // sequences on (the window unrolled for the common width 4).
  const auto conv = width == 4 ? conv_channels<3> : conv_channels<0>;
  at::parallel_for(0, batch * conv_dim, 2048, [&](int64_t begin, int64_t end) {
    conv(in_p, row_stride, inter, conv_p, conv_dim, kept, slot_p, w_p, b_p, xc_p, begin, end);
    silu_row(xc_p + begin, nullptr, xc_p + begin, end - begin);
  });

  // 2. the recurrence of every (sequence, head): one read and one write of its state, the state
  // of the next (sequence, head) of this thread prefetched while the end of this one is stepped.
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads, g = h / per_group;
      const float* row_in = in_p + b * row_stride;
      const float dt = std::min(std::max(softplus(row_in[inter + conv_dim + h] + dtb_p[h]), lo), hi);
      const float decay = std::exp(dt * a_p[h]);
      const float* xv = xc_p + b * conv_dim + h * hdim;
      const float* Bv = xc_p + b * conv_dim + inter + g * dstate;
      const float* Cv = xc_p + b * conv_dim + inter + (groups + g) * dstate;
      float* state = ssm_p + (slot_p[b] * heads + h) * hdim * dstate;
      const float* next = i + 1 < end ? ssm_p + (slot_p[(i + 1) / heads] * heads + (i + 1) % heads) * hdim * dstate : nullptr;
      step_head(state, next, hdim, dstate, xv, Bv, Cv, dt, decay, d_p[h], out_p + b * inter + h * hdim);
    }
  });

  // 3. the gated group norm, in place in `out`.
  if (norm) {
    const float* wn_p = wnorm.data_ptr<float>();
    const int64_t per_row = inter / norm_group;
    at::parallel_for(0, batch * per_row, grain_for(norm_group), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / per_row, offset = (i % per_row) * norm_group;
        float* y = out_p + b * inter + offset;
        normalise_group(y, in_p + b * row_stride + offset, wn_p + offset, y, norm_group, e);
      }
    });
  }
  return out;
}

// RMSNorm over the last dimension in one pass per row: weight * x / sqrt(mean(x^2) + eps).
// With `gate`, Mamba2's gated norm: x * silu(gate) first, normalised over groups of `group` channels.
// x and gate may be views with any row stride (channels contiguous).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> gate, int64_t group,
                       double eps) {
  check_fp32(x, "x");
  check_fp32(weight, "weight");
  auto xc = x.stride(-1) == 1 && x.dim() == 2 ? x : x.contiguous().view({-1, x.size(-1)});
  const int64_t width = xc.size(-1), rows = xc.size(0), x_stride = xc.stride(0);
  TORCH_CHECK(width % group == 0 && weight.numel() == width);
  torch::Tensor gc;
  int64_t g_stride = 0;
  if (gate.has_value()) {
    check_fp32(*gate, "gate");
    gc = gate->stride(-1) == 1 && gate->dim() == 2 ? *gate : gate->contiguous().view({-1, width});
    TORCH_CHECK(gc.size(0) == rows && gc.size(1) == width);
    g_stride = gc.stride(0);
  }
  auto out = torch::empty({rows, width}, xc.options());
  auto w = weight.contiguous();
  const float *x_p = xc.data_ptr<float>(), *w_p = w.data_ptr<float>();
  const float* g_p = gc.defined() ? gc.data_ptr<float>() : nullptr;
  float* o_p = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t per_row = width / group;
  at::parallel_for(0, rows * per_row, grain_for(group), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / per_row, offset = (i % per_row) * group;
      normalise_group(x_p + r * x_stride + offset, g_p ? g_p + r * g_stride + offset : nullptr, w_p + offset,
                 o_p + r * width + offset, group, e);
    }
  });
  return out.view(x.sizes());
}

// The residual stream and the next norm in one pass per row:
//   h <- h + alpha * delta   (in place)      returns weight * rmsnorm(h)
// h [N, width] contiguous, delta [N, width] (row stride free, channels contiguous).
torch::Tensor add_rms_norm(torch::Tensor h, torch::Tensor delta, double alpha, torch::Tensor weight, double eps) {
  check_fp32(h, "h");
  check_fp32(delta, "delta");
  check_fp32(weight, "weight");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && delta.dim() == 2 && delta.stride(1) == 1);
  TORCH_CHECK(delta.size(0) == h.size(0) && delta.size(1) == h.size(1) && weight.numel() == h.size(1));
  const int64_t rows = h.size(0), width = h.size(1), d_stride = delta.stride(0);
  auto out = torch::empty_like(h);
  auto w = weight.contiguous();
  float* h_p = h.data_ptr<float>();
  const float *d_p = delta.data_ptr<float>(), *w_p = w.data_ptr<float>();
  float* o_p = out.data_ptr<float>();
  const float a = static_cast<float>(alpha), e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_for(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* hr = h_p + r * width;
      const float* dr = d_p + r * d_stride;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) hr[j] = hr[j] + a * dr[j];
      normalise_group(hr, nullptr, w_p, o_p + r * width, width, e);
    }
  });
  return out;
}

// The MLP's activation on the up projection's output x [N, width]:
//   gated (SwiGLU):   x = [gate | up] (width 2I)  ->  silu(gate) * up   [N, I]
//   not gated:        relu(x)^2, in place on x   ->  x                [N, width]
torch::Tensor mlp_activation(torch::Tensor x, bool gated) {
  check_fp32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous());
  const int64_t rows = x.size(0), width = x.size(1), out_width = gated ? width / 2 : width;
  TORCH_CHECK(!gated || width % 2 == 0);
  auto out = gated ? torch::empty({rows, out_width}, x.options()) : x;
  const float* x_p = x.data_ptr<float>();
  float* o_p = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_for(out_width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x_p + r * width;
      float* o = o_p + r * out_width;
      if (gated) {
        silu_row(xr, xr + out_width, o, out_width);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < out_width; ++j) {
          const float v = xr[j] > 0.0f ? xr[j] : 0.0f;
          o[j] = v * v;
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mamba_decode", &mamba_decode, "Mamba2 decode step after in_proj: conv, recurrence, gated norm, in place by slot");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged K/V, read in place",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("num_keys"),
        py::arg("scale"), py::arg("k_new") = py::none(), py::arg("v_new") = py::none(), py::arg("kv_slots") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm (optionally gated, grouped) in one pass per row");
  m.def("add_rms_norm", &add_rms_norm, "residual add in place, then RMSNorm of the sum");
  m.def("mlp_activation", &mlp_activation, "SwiGLU or squared ReLU on the up projection's output");
}
