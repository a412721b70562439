// The Mamba2 prefill scan as the plain recurrence, one (sequence, head) per task, built from
// source by workers/model/scan_kernels.py when the runner turns the fast path on (start-up,
// ModelRunner.set_fast_kernels), never inside a forward. The pure-torch references beside it
// are `ssd.chunked_scan` (the SSD formulation after ssd_minimal.py), `ssd.recurrent_step` and,
// without a compiler, `ssd.chunked_scan_grouped`; tests hold them equal.
//
// Why the recurrence and not SSD on a CPU: SSD trades the sequential scan for matmuls that a
// GPU runs well, at the price of [chunk x chunk] decay matrices per head and several
// elementwise passes over them. Here a head's state (p x n fp32, 32 KB for 64 x 128) stays in
// the core's L1/L2 for the whole run, and each token costs one vectorised pass over it:
//
//     for t in run:    decay = exp(dt_t * A)
//                      state[p, :] = decay * state[p, :] + (dt_t * x_t[p]) * B_t[:]
//                      y_t[p]      = state[p, :] . C_t[:]
//
// which is fewer flops than SSD's four matmuls and no memory traffic beyond reading the inputs.
// Padding is not run at all (`lengths`); the SSD fallback runs it with dt = 0 instead.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

// x [b, L, h, p], dt [b, L, h] (after softplus and clamping), A [h], B/C [b, L, g, n],
// initial_state [b, h, p, n], lengths [b] (tokens of each row; the rest is padding, skipped)
//   ->  (y [b, L, h, p] without the D skip, 0 on padding; final state [b, h, p, n])
//
//     row 0: t t t t t t t t     a wave pads its runs to the longest; the recurrence stops at
//     row 1: t t t . . . . .     each row's own length, so a short suffix batched with a long
//                  ^ lengths[1]  chunk costs its own tokens, not the chunk's
std::vector<torch::Tensor> recurrent_scan(torch::Tensor x, torch::Tensor dt, torch::Tensor A, torch::Tensor Bm,
                                          torch::Tensor Cm, torch::Tensor initial_state, torch::Tensor lengths) {
  for (const auto& t : {x, dt, A, Bm, Cm, initial_state}) {
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat32, "recurrent_scan wants contiguous fp32");
  }
  TORCH_CHECK(x.dim() == 4 && dt.dim() == 3 && Bm.dim() == 4 && Cm.sizes() == Bm.sizes(), "shapes");
  const int64_t batch = x.size(0), length = x.size(1), heads = x.size(2), hdim = x.size(3);
  const int64_t groups = Bm.size(2), dstate = Bm.size(3);
  TORCH_CHECK(heads % groups == 0 && dt.size(0) == batch && dt.size(1) == length && dt.size(2) == heads, "dt shape");
  TORCH_CHECK(Bm.size(0) == batch && Bm.size(1) == length && A.numel() == heads, "B / A shapes");
  TORCH_CHECK(initial_state.size(0) == batch && initial_state.size(1) == heads && initial_state.size(2) == hdim &&
                  initial_state.size(3) == dstate,
              "initial_state shape");
  TORCH_CHECK(lengths.numel() == batch, "one length per row");
  auto len = lengths.contiguous().to(torch::kLong);
  const int64_t* len_p = len.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len_p[b] >= 0 && len_p[b] <= length, "lengths must lie in [0, L]");
  }
  const int64_t per_group = heads / groups;
  auto y = torch::zeros_like(x);
  auto state = initial_state.clone();
  const float *x_p = x.data_ptr<float>(), *dt_p = dt.data_ptr<float>(), *a_p = A.data_ptr<float>();
  const float *b_p = Bm.data_ptr<float>(), *c_p = Cm.data_ptr<float>();
  float *y_p = y.data_ptr<float>(), *s_p = state.data_ptr<float>();

  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads, g = h / per_group;
      float* st = s_p + i * hdim * dstate;  // updated in place: the clone is the final state
      for (int64_t t = 0; t < len_p[b]; ++t) {
        const int64_t token = b * length + t;
        const float step = dt_p[token * heads + h];
        const float decay = std::exp(step * a_p[h]);
        const float* xv = x_p + (token * heads + h) * hdim;
        const float* Bv = b_p + (token * groups + g) * dstate;
        const float* Cv = c_p + (token * groups + g) * dstate;
        float* yv = y_p + (token * heads + h) * hdim;
        int64_t p = 0;
        // Four rows at a time: four independent sums, so the FMA latency chain of one row's
        // dot product with C does not serialise the pass.
        for (; p + 4 <= hdim; p += 4) {
          float* r0 = st + p * dstate;
          float *r1 = r0 + dstate, *r2 = r1 + dstate, *r3 = r2 + dstate;
          const float d0 = step * xv[p], d1 = step * xv[p + 1], d2 = step * xv[p + 2], d3 = step * xv[p + 3];
          float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
          for (int64_t n = 0; n < dstate; ++n) {
            const float bn = Bv[n], cn = Cv[n];
            const float v0 = r0[n] * decay + d0 * bn, v1 = r1[n] * decay + d1 * bn;
            const float v2 = r2[n] * decay + d2 * bn, v3 = r3[n] * decay + d3 * bn;
            r0[n] = v0;
            r1[n] = v1;
            r2[n] = v2;
            r3[n] = v3;
            a0 += v0 * cn;
            a1 += v1 * cn;
            a2 += v2 * cn;
            a3 += v3 * cn;
          }
          yv[p] = a0;
          yv[p + 1] = a1;
          yv[p + 2] = a2;
          yv[p + 3] = a3;
        }
        for (; p < hdim; ++p) {
          float* row = st + p * dstate;
          const float dx = step * xv[p];
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t n = 0; n < dstate; ++n) {
            const float v = row[n] * decay + dx * Bv[n];
            row[n] = v;
            acc += v * Cv[n];
          }
          yv[p] = acc;
        }
      }
    }
  });
  return {y, state};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("recurrent_scan", &recurrent_scan, "Mamba2 prefill scan as the recurrence, state kept in cache");
}
