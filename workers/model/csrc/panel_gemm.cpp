// Weight matmuls for few rows (decode), streaming each weight once at memory bandwidth.
// Built from source at start-up (workers/model/panel_gemm.py); the tuning in
// workers/model/linear_tuning.py picks it per weight shape and row bucket only where it measures
// faster than F.linear and oneDNN, which stay the reference and the other choice.
//
// At 1-16 rows a linear is a pass over its weight: the arithmetic is small and what counts is
// reading the weight once, in order, with every loaded vector used by all the rows. So the
// weight [N, K] is packed once into panels of 16 output columns, k-major:
//
//     panels [ceil(N/16), K, 16]      panel j, step k = W[16j .. 16j+15, k]   (zero past N)
//
// and for each panel the rows' 16 outputs sit in registers (two 8-wide vectors per row) while
// k runs: one pass over the panel per group of up to kRowGroup rows (a second group re-reads
// the panel from L1/L2, not from memory). Threads take contiguous runs of panels, so each
// streams one region. The vector type is GCC's portable extension: -march=native turns it into
// AVX2/AVX-512 (or pairs of SSE) instructions.
//
// Summation order: per output, k ascending in fp32 FMAs, like a plain dot product; results
// differ from MKL/oneDNN in the last bits (the fast path's documented tolerance), never in
// which rows or columns they cover.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace {

typedef float vec8 __attribute__((vector_size(32)));
constexpr int64_t kPanel = 16;   // output columns per panel: two vec8 per row
constexpr int64_t kRowGroup = 6;  // rows whose accumulators (2 x 6 = 12 vectors) stay in registers

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof(v)); }

// Rows [0, R) of x times one panel: out[r, 0..width) for the panel's `width` (<= 16) columns.
// `next`: the panel to fetch into the caches meanwhile (one 64-byte line per k), or null.
template <int R>
inline void panel_rows(const float* x, int64_t x_stride, const float* panel, int64_t K, const float* bias,
                       float* out, int64_t out_stride, int64_t width, const float* next) {
  vec8 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = vec8{};
  for (int64_t k = 0; k < K; ++k) {
    if (next) __builtin_prefetch(next + k * kPanel, 0, 3);
    const vec8 w0 = load8(panel + k * kPanel), w1 = load8(panel + k * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * x_stride + k];
      lo[r] += xv * w0;
      hi[r] += xv * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    float row[kPanel];
    store8(row, lo[r]);
    store8(row + 8, hi[r]);
    float* o = out + r * out_stride;
    for (int64_t c = 0; c < width; ++c) o[c] = bias ? row[c] + bias[c] : row[c];
  }
}

using PanelRowsFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,
                             const float*);
constexpr PanelRowsFn kPanelRows[kRowGroup + 1] = {nullptr,          panel_rows<1>, panel_rows<2>, panel_rows<3>,
                                                   panel_rows<4>, panel_rows<5>, panel_rows<6>};

}  // namespace

// weight [N, K] fp32  ->  panels [ceil(N/16), K, 16], zero-padded past N.
torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "pack_panels wants a 2-d fp32 weight");
  auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto packed = torch::zeros({panels, K, kPanel}, w.options());
  const float* w_p = w.data_ptr<float>();
  float* p_p = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t c = 0; c < kPanel && j * kPanel + c < N; ++c) {
        const float* src = w_p + (j * kPanel + c) * K;
        float* dst = p_p + j * K * kPanel + c;
        for (int64_t k = 0; k < K; ++k) dst[k * kPanel] = src[k];
      }
    }
  });
  return packed;
}

// x [..., K] fp32, panels from pack_panels, out_features N, bias [N] or None  ->  [..., N]
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && panels.scalar_type() == torch::kFloat32,
              "panel_linear wants fp32");
  TORCH_CHECK(panels.is_contiguous() && panels.dim() == 3 && panels.size(2) == kPanel);
  const int64_t K = panels.size(1), N = out_features, num_panels = panels.size(0);
  TORCH_CHECK(x.size(-1) == K, "panel_linear: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(num_panels == (N + kPanel - 1) / kPanel, "panel_linear: panels do not match out_features");
  auto xc = x.contiguous();
  const int64_t M = xc.numel() / K;
  auto out_sizes = xc.sizes().vec();
  out_sizes.back() = N;
  auto out = torch::empty(out_sizes, xc.options());
  torch::Tensor bc;
  if (bias.has_value()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == torch::kFloat32 && bc.numel() == N);
  }
  const float* x_p = xc.data_ptr<float>();
  const float* p_p = panels.data_ptr<float>();
  const float* b_p = bc.defined() ? bc.data_ptr<float>() : nullptr;
  float* o_p = out.data_ptr<float>();
  // Enough panels per task that a thread streams a long run; few enough that both threads work.
  const int64_t grain = std::max<int64_t>(1, num_panels / (2 * at::get_num_threads()));
  at::parallel_for(0, num_panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float* panel = p_p + j * K * kPanel;
      const int64_t col = j * kPanel, width = std::min(kPanel, N - col);
      // Rows in groups as even as possible (8 = 4 + 4, not 6 + 2): a small group has too few
      // independent accumulator chains to hide the FMA latency.
      const int64_t groups = (M + kRowGroup - 1) / kRowGroup;
      for (int64_t g = 0, r = 0; g < groups; ++g) {
        const int64_t rows = (M - r) / (groups - g);
        const float* next = g + 1 == groups && j + 1 < end ? panel + K * kPanel : nullptr;
        kPanelRows[rows](x_p + r * K, K, panel, K, b_p ? b_p + col : nullptr, o_p + r * N + col, N, width, next);
        r += rows;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_panels", &pack_panels, "pack a [N, K] weight into [ceil(N/16), K, 16] panels");
  m.def("panel_linear", &panel_linear, "x @ W.T (+ bias) over packed panels, for few rows");
}
