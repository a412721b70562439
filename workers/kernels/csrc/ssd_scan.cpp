// The Mamba2 prefill scan as the plain recurrence, one (sequence, head) per task, built from
// source by workers/kernels/extensions.py when the runner turns the fast path on (start-up,
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
// Most tokens skip the decay's multiply by keeping the state over a running scale, two at a
// time (`plan_run`, `step_pair`); the slot always ends holding the state itself.
// Padding is not run at all (`lengths`); the SSD fallback runs it with dt = 0 instead.
//
// `prefill_conv` and `prefill_scan` are the mixer's whole prefill on the flat token batch
// (MambaMixer._prefill_fused): they read the in_proj output rows in place, update the conv and
// SSM states in place at each segment's slot, and write y rows in place, so the padded wave,
// its gather/scatter copies and the torch conv1d of MambaMixer._prefill never exist.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// One head's recurrence over tokens 0..count-1 for state rows [p_begin, p_end):
//   state[p, :] = decay_t * state[p, :] + (step_t * x_t[p]) * B_t[:];  y_t[p] = state[p, :] . C_t[:] + skip * x_t[p]
// Inputs of token t sit at base + t * stride (the callers' layouts differ: a padded [b, L, ...]
// wave or the flat in_proj rows); `state` points at row 0 of the head, [p, n] contiguous.
struct HeadRun {
  const float* step;  // after softplus and clamping
  int64_t step_stride;
  const float* x;
  int64_t x_stride;
  const float* B;
  const float* C;
  int64_t bc_stride;
  float* y;
  int64_t y_stride;
  float A;
  float skip;  // D, or 0 (recurrent_scan leaves the skip to its caller)
};

#if defined(__AVX2__) && defined(__FMA__)
// [sum(a0), sum(a1), sum(a2), sum(a3)]
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

// The stored rows of a run are the state over a running scale, state_t = scale_t * u_t, with
// scale_t = exp(A * (step_{r+1} + ... + step_t)) since the last "direct" token r. Then the
// usual token needs no pass multiplying the whole state by its decay:
//
//     direct:  u = exp(A * sum) * u + (step * x) B;   y = u . C + D x;          scale := 1
//     scaled:  u = u + (step / scale_t * x) B;        y = scale_t (u . C) + D x
//
// two FMAs per state element instead of a multiply and two FMAs. A token is direct when the
// scale would leave [exp(-kLogScaleRange), exp(kLogScaleRange)] (u grows as 1/scale), and the
// run's last token always is, so the slot ends holding the state itself. Both forms add the
// same terms, each weighted by the decay from its token to t: the scaled one applies that
// weight as (1 / scale_i) * scale_t instead of a product of per-token decays, within a few ulps.
constexpr float kLogScaleRange = 20.0f;  // 1/scale <= 5e8: far from fp32 overflow for any sane input

//   u[p, :] = keep * u[p, :] + (gain * x_t[p]) * B_t[:];   y_t[p] = out * (u[p, :] . C_t[:]) + skip * x_t[p]
struct TokenStep {
  float keep;  // exp(A * sum) on a direct step; 1 on a scaled one (no multiply)
  float gain;  // step, or step / scale_t
  float out;   // 1, or scale_t
};

inline void plan_run(const HeadRun& r, int64_t count, std::vector<TokenStep>& plan) {
  plan.resize(count);
  float log_scale = 0.0f;  // of the stored rows
  for (int64_t t = 0; t < count; ++t) {
    const float step = r.step[t * r.step_stride];
    const float next = log_scale + step * r.A;
    if (t + 1 == count || !(next >= -kLogScaleRange && next <= kLogScaleRange)) {  // NaN: direct
      plan[t] = {std::exp(next), step, 1.0f};
      log_scale = 0.0f;
    } else {
      const float scale = std::exp(next);
      plan[t] = {1.0f, step / scale, scale};
      log_scale = next;
    }
  }
}

// One token over rows [p_begin, p_end) of a head's stored rows `state` ([p, n] contiguous).
inline void step_one(const HeadRun& r, const TokenStep& s, int64_t t, int64_t count, float* state, int64_t dstate,
                     int64_t p_begin, int64_t p_end) {
  const float* xv = r.x + t * r.x_stride;
  const float* Bv = r.B + t * r.bc_stride;
  const float* Cv = r.C + t * r.bc_stride;
  float* yv = r.y + t * r.y_stride;
  int64_t p = p_begin;
#if defined(__AVX2__) && defined(__FMA__)
  // Four rows at a time, B and C loaded once for the four: the auto-vectorised loop reloaded
  // B per row and spilled, and was load-port bound (1.1-1.5x slower, bench.kernel_speed).
  // Four independent sums, so the FMA latency chain of one row's dot product with C does
  // not serialise the pass.
  if (dstate % 8 == 0) {
    if (t + 1 < count) {  // the next token's rows sit a row stride away: no prefetcher sees them
      const float *nb = Bv + r.bc_stride, *nc = Cv + r.bc_stride;
      for (int64_t n = 0; n < dstate; n += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(nb + n), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(nc + n), _MM_HINT_T0);
      }
      _mm_prefetch(reinterpret_cast<const char*>(xv + r.x_stride + p_begin), _MM_HINT_T0);
    }
    const __m256 keep = _mm256_set1_ps(s.keep);
    for (; p + 4 <= p_end; p += 4) {
      float* r0 = state + p * dstate;
      float *r1 = r0 + dstate, *r2 = r1 + dstate, *r3 = r2 + dstate;
      const __m256 d0 = _mm256_set1_ps(s.gain * xv[p]), d1 = _mm256_set1_ps(s.gain * xv[p + 1]);
      const __m256 d2 = _mm256_set1_ps(s.gain * xv[p + 2]), d3 = _mm256_set1_ps(s.gain * xv[p + 3]);
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t n = 0; n < dstate; n += 8) {
        const __m256 b = _mm256_loadu_ps(Bv + n), c = _mm256_loadu_ps(Cv + n);
        const __m256 v0 = _mm256_fmadd_ps(d0, b, _mm256_mul_ps(_mm256_loadu_ps(r0 + n), keep));
        const __m256 v1 = _mm256_fmadd_ps(d1, b, _mm256_mul_ps(_mm256_loadu_ps(r1 + n), keep));
        const __m256 v2 = _mm256_fmadd_ps(d2, b, _mm256_mul_ps(_mm256_loadu_ps(r2 + n), keep));
        const __m256 v3 = _mm256_fmadd_ps(d3, b, _mm256_mul_ps(_mm256_loadu_ps(r3 + n), keep));
        _mm256_storeu_ps(r0 + n, v0);
        _mm256_storeu_ps(r1 + n, v1);
        _mm256_storeu_ps(r2 + n, v2);
        _mm256_storeu_ps(r3 + n, v3);
        a0 = _mm256_fmadd_ps(v0, c, a0);
        a1 = _mm256_fmadd_ps(v1, c, a1);
        a2 = _mm256_fmadd_ps(v2, c, a2);
        a3 = _mm256_fmadd_ps(v3, c, a3);
      }
      const __m128 x4 = _mm_loadu_ps(xv + p);  // y = out * (u . C) + skip * x
      const __m128 dots = _mm_mul_ps(_mm_set1_ps(s.out), sum4(a0, a1, a2, a3));
      _mm_storeu_ps(yv + p, _mm_fmadd_ps(_mm_set1_ps(r.skip), x4, dots));
    }
  }
#endif
  // The rows left (d_state not a multiple of 8, odd rows, no AVX2): the recurrence of
  // `step_state_row` (vector_math.h), but summed in the order of the compiler's vectorised
  // reduction, which its explicit lane order does not reproduce.
  for (; p < p_end; ++p) {
    float* row = state + p * dstate;
    const float dx = s.gain * xv[p];
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t n = 0; n < dstate; ++n) {
      const float v = row[n] * s.keep + dx * Bv[n];
      row[n] = v;
      acc += v * Cv[n];
    }
    yv[p] = s.out * acc + r.skip * xv[p];
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Two scaled tokens t, t+1 over rows [p_begin, p_end), dstate % 8 == 0: each state vector is
// loaded and stored once for both tokens, and four rows x two tokens keep eight independent
// sums, so neither the loads and stores nor the FMA latency of a sum bind: one token at a time
// with two FMAs per element ran no faster than the old three (store- and latency-bound).
// Measured on one Zen 3 core (128 tokens, 32 x 128 state rows): 22.9 TSC cycles per row and
// token for the direct-only pass, 16.6 here; the FMA bound is 12.4.
inline void step_pair(const HeadRun& r, const TokenStep& s0, const TokenStep& s1, int64_t t, int64_t count,
                      float* state, int64_t dstate, int64_t p_begin, int64_t p_end) {
  const float *x0 = r.x + t * r.x_stride, *x1 = x0 + r.x_stride;
  const float *B0 = r.B + t * r.bc_stride, *B1 = B0 + r.bc_stride;
  const float *C0 = r.C + t * r.bc_stride, *C1 = C0 + r.bc_stride;
  float *y0 = r.y + t * r.y_stride, *y1 = y0 + r.y_stride;
  for (int64_t ahead = 2; ahead < 4 && t + ahead < count; ++ahead) {  // the next pair's rows
    const float *nb = r.B + (t + ahead) * r.bc_stride, *nc = r.C + (t + ahead) * r.bc_stride;
    for (int64_t n = 0; n < dstate; n += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(nb + n), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(nc + n), _MM_HINT_T0);
    }
    _mm_prefetch(reinterpret_cast<const char*>(r.x + (t + ahead) * r.x_stride + p_begin), _MM_HINT_T0);
  }
  const __m128 out = _mm_setr_ps(s0.out, s0.out, s1.out, s1.out), skip = _mm_set1_ps(r.skip);
  int64_t p = p_begin;
  __m256 gain[8];  // in memory on purpose: the FMAs read them as operands, the registers hold the 8 sums
  for (; p + 4 <= p_end; p += 4) {
    float* r0 = state + p * dstate;
    for (int j = 0; j < 4; ++j) gain[j] = _mm256_set1_ps(s0.gain * x0[p + j]), gain[4 + j] = _mm256_set1_ps(s1.gain * x1[p + j]);
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t n = 0; n < dstate; n += 8) {
      const __m256 b0 = _mm256_loadu_ps(B0 + n), c0 = _mm256_loadu_ps(C0 + n);
      const __m256 b1 = _mm256_loadu_ps(B1 + n), c1 = _mm256_loadu_ps(C1 + n);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        float* row = r0 + j * dstate + n;
        __m256 u = _mm256_fmadd_ps(gain[j], b0, _mm256_loadu_ps(row));
        acc[j] = _mm256_fmadd_ps(u, c0, acc[j]);
        u = _mm256_fmadd_ps(gain[4 + j], b1, u);
        acc[4 + j] = _mm256_fmadd_ps(u, c1, acc[4 + j]);
        _mm256_storeu_ps(row, u);
      }
    }
    const __m128 o0 = _mm_set1_ps(s0.out), o1 = _mm_set1_ps(s1.out);
    _mm_storeu_ps(y0 + p, _mm_fmadd_ps(skip, _mm_loadu_ps(x0 + p), _mm_mul_ps(o0, sum4(acc[0], acc[1], acc[2], acc[3]))));
    _mm_storeu_ps(y1 + p, _mm_fmadd_ps(skip, _mm_loadu_ps(x1 + p), _mm_mul_ps(o1, sum4(acc[4], acc[5], acc[6], acc[7]))));
  }
  for (; p + 2 <= p_end; p += 2) {
    float *ra = state + p * dstate, *rb = ra + dstate;
    const __m256 ga0 = _mm256_set1_ps(s0.gain * x0[p]), gb0 = _mm256_set1_ps(s0.gain * x0[p + 1]);
    const __m256 ga1 = _mm256_set1_ps(s1.gain * x1[p]), gb1 = _mm256_set1_ps(s1.gain * x1[p + 1]);
    __m256 aa0 = _mm256_setzero_ps(), ab0 = aa0, aa1 = aa0, ab1 = aa0;
    for (int64_t n = 0; n < dstate; n += 8) {
      const __m256 b0 = _mm256_loadu_ps(B0 + n), c0 = _mm256_loadu_ps(C0 + n);
      const __m256 b1 = _mm256_loadu_ps(B1 + n), c1 = _mm256_loadu_ps(C1 + n);
      __m256 ua = _mm256_fmadd_ps(ga0, b0, _mm256_loadu_ps(ra + n));
      __m256 ub = _mm256_fmadd_ps(gb0, b0, _mm256_loadu_ps(rb + n));
      aa0 = _mm256_fmadd_ps(ua, c0, aa0);
      ab0 = _mm256_fmadd_ps(ub, c0, ab0);
      ua = _mm256_fmadd_ps(ga1, b1, ua);
      ub = _mm256_fmadd_ps(gb1, b1, ub);
      aa1 = _mm256_fmadd_ps(ua, c1, aa1);
      ab1 = _mm256_fmadd_ps(ub, c1, ab1);
      _mm256_storeu_ps(ra + n, ua);
      _mm256_storeu_ps(rb + n, ub);
    }
    // [row p, row p+1] of token t, then of token t+1: out * dots + skip * x
    const __m128 xs = _mm_setr_ps(x0[p], x0[p + 1], x1[p], x1[p + 1]);
    const __m128 y = _mm_fmadd_ps(skip, xs, _mm_mul_ps(out, sum4(aa0, ab0, aa1, ab1)));
    _mm_storel_pi(reinterpret_cast<__m64*>(y0 + p), y);
    _mm_storeh_pi(reinterpret_cast<__m64*>(y1 + p), y);
  }
  if (p < p_end) {  // an odd row left: one token after the other
    step_one(r, s0, t, count, state, dstate, p, p_end);
    step_one(r, s1, t + 1, count, state, dstate, p, p_end);
  }
}
#endif

// A task's scratch, reused over its runs.
struct RunScratch {
  std::vector<TokenStep> plan;
  std::vector<float> stage;  // y rows of kStageTokens tokens
};

// y rows are staged in L1 for this many tokens, then copied out together. Written in place, a
// y store that misses the caches (y is megabytes, a row apart per token) held back every later
// store, the state's own included, since stores commit in order: 12 Granite layers at 8 x 128
// tokens took 143 ms on one core against 85 with y written to a scratch line (ab over the
// same inputs). The block's y lines are fetched for writing while it computes.
constexpr int64_t kStageTokens = 16;

// One head's recurrence over tokens 0..count-1 for state rows [p_begin, p_end) (see HeadRun),
// planned into direct and scaled tokens (above).
// `fresh`: the run starts from the zero state (a sequence's first tokens): `state` is written,
// never read, so a fresh slot needs no zeroing before the step.
inline void scan_head_rows(const HeadRun& r, float* state, int64_t dstate, int64_t p_begin, int64_t p_end,
                           int64_t count, bool fresh, RunScratch& scratch) {
  if (fresh) std::memset(state + p_begin * dstate, 0, sizeof(float) * (p_end - p_begin) * dstate);
  plan_run(r, count, scratch.plan);
  const int64_t width = p_end - p_begin;
  scratch.stage.resize(kStageTokens * width);
  for (int64_t t0 = 0; t0 < count; t0 += kStageTokens) {
    const int64_t n = std::min(kStageTokens, count - t0);
    for (int64_t t = 0; t < n; ++t) {
      float* row = r.y + (t0 + t) * r.y_stride + p_begin;
      for (int64_t q = 0; q < width; q += 16) __builtin_prefetch(row + q, 1, 3);
      __builtin_prefetch(row + width - 1, 1, 3);
    }
    HeadRun block = r;  // tokens t0.. of the run, y rows into the stage
    block.step += t0 * r.step_stride;
    block.x += t0 * r.x_stride;
    block.B += t0 * r.bc_stride;
    block.C += t0 * r.bc_stride;
    block.y = scratch.stage.data() - p_begin;
    block.y_stride = width;
    const TokenStep* plan = scratch.plan.data() + t0;
    const int64_t left = count - t0;  // for the prefetches: the tokens after this block are read next
    for (int64_t t = 0; t < n;) {
#if defined(__AVX2__) && defined(__FMA__)
      if (dstate % 8 == 0 && t + 1 < n && plan[t].keep == 1.0f && plan[t + 1].keep == 1.0f) {
        step_pair(block, plan[t], plan[t + 1], t, left, state, dstate, p_begin, p_end);
        t += 2;
        continue;
      }
#endif
      step_one(block, plan[t], t, left, state, dstate, p_begin, p_end);
      ++t;
    }
    for (int64_t t = 0; t < n; ++t) {
      std::memcpy(r.y + (t0 + t) * r.y_stride + p_begin, scratch.stage.data() + t * width, sizeof(float) * width);
    }
  }
}

struct Segments {
  std::vector<int64_t> start, count, slot;
  std::vector<uint8_t> fresh;  // starts from the zero state: the slot's old state is never read
};

// starts / counts / slots [k]: segment i is flat rows start[i] .. start[i]+count[i]-1, its state in slot[i];
// fresh [k] (bool, or None: no segment is fresh): segment i is a sequence's first tokens.
Segments read_segments(const torch::Tensor& starts, const torch::Tensor& counts, const torch::Tensor& slots,
                       const std::optional<torch::Tensor>& fresh, int64_t rows, int64_t num_slots) {
  TORCH_CHECK(starts.numel() == counts.numel() && starts.numel() == slots.numel(), "one start, count, slot per segment");
  auto s = starts.contiguous().to(torch::kLong), c = counts.contiguous().to(torch::kLong),
       l = slots.contiguous().to(torch::kLong);
  Segments seg;
  seg.start.assign(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + s.numel());
  seg.count.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  seg.slot.assign(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
  seg.fresh.assign(seg.start.size(), 0);
  if (fresh.has_value()) {
    TORCH_CHECK(fresh->numel() == starts.numel(), "one fresh flag per segment");
    auto f = fresh->contiguous().to(torch::kBool);
    std::copy(f.data_ptr<bool>(), f.data_ptr<bool>() + f.numel(), seg.fresh.begin());
  }
  for (size_t i = 0; i < seg.start.size(); ++i) {
    TORCH_CHECK(seg.start[i] >= 0 && seg.count[i] >= 0 && seg.start[i] + seg.count[i] <= rows, "segment rows out of range");
    TORCH_CHECK(seg.slot[i] >= 0 && seg.slot[i] < num_slots, "state slot out of range");
    for (size_t j = 0; j < i; ++j) TORCH_CHECK(seg.slot[j] != seg.slot[i], "segments of one call need distinct slots");
  }
  return seg;
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.stride(1) == 1, name,
              " must be fp32 rows [tokens, channels] with unit channel stride");
}

}  // namespace

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
    RunScratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads, g = h / per_group;
      const int64_t first = b * length;  // token 0 of row b
      const HeadRun run{dt_p + first * heads + h, heads,
                        x_p + (first * heads + h) * hdim, heads * hdim,
                        b_p + (first * groups + g) * dstate, c_p + (first * groups + g) * dstate, groups * dstate,
                        y_p + (first * heads + h) * hdim, heads * hdim,
                        a_p[h], 0.0f};
      // updated in place: the clone is the final state
      scan_head_rows(run, s_p + i * hdim * dstate, dstate, 0, hdim, len_p[b], false, scratch);
    }
  });
  return {y, state};
}

// Causal depthwise conv + SiLU of prefill segments on the flat token rows, conv states in place.
//   xbc [N, C] (rows may be strided: a column slice of the in_proj output), conv_cache [S, C, K-1]
//   (the last K-1 inputs of each slot, oldest first), weight [C, K], bias [C] or empty
//   -> out [N, C]: silu(conv) on the segments' rows (other rows left uninitialised)
//
//     conv input of segment i:  [ cache[slot i] (K-1) | xbc rows start .. start+count-1 ]
//     out row start+t         = silu(bias + sum_k w[k] * input[t + k])
//     cache[slot i] afterwards = the last K-1 entries of that input
//   fresh [k] bool or None: a fresh segment's cached inputs are zeros (its slot is not read)
torch::Tensor prefill_conv(torch::Tensor xbc, torch::Tensor conv_cache, torch::Tensor starts, torch::Tensor counts,
                           torch::Tensor slots, torch::Tensor weight, torch::Tensor bias,
                           std::optional<torch::Tensor> fresh) {
  check_rows(xbc, "xbc");
  TORCH_CHECK(conv_cache.is_contiguous() && conv_cache.scalar_type() == torch::kFloat32 && conv_cache.dim() == 3,
              "conv_cache must be contiguous fp32 [slots, channels, K-1]");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == torch::kFloat32 && weight.dim() == 2, "weight [C, K] fp32");
  const int64_t rows = xbc.size(0), channels = xbc.size(1), width = weight.size(1), kept = width - 1;
  TORCH_CHECK(weight.size(0) == channels && conv_cache.size(1) == channels && conv_cache.size(2) == kept, "conv shapes");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == channels && bias.scalar_type() == torch::kFloat32), "bias [C] fp32");
  const Segments seg = read_segments(starts, counts, slots, fresh, rows, conv_cache.size(0));
  auto bias_c = bias.contiguous();
  auto out = torch::empty({rows, channels}, xbc.options().memory_format(torch::MemoryFormat::Contiguous));
  const int64_t x_stride = xbc.stride(0);
  const float* x_p = xbc.data_ptr<float>();
  const float* w_p = weight.data_ptr<float>();
  const float* b_p = bias_c.numel() ? bias_c.data_ptr<float>() : nullptr;
  float* cache_p = conv_cache.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  constexpr int64_t kBlock = 64;  // channels per task: vector width x a few, weights in registers/L1
  const int64_t blocks = (channels + kBlock - 1) / kBlock;
  const int64_t k = static_cast<int64_t>(seg.start.size());
  at::parallel_for(0, k * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wt(width * kBlock), hist(kept * kBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / blocks, c0 = (task % blocks) * kBlock, nc = std::min(kBlock, channels - c0);
      const int64_t start = seg.start[i], count = seg.count[i];
      float* cache = cache_p + seg.slot[i] * channels * kept;
      for (int64_t c = 0; c < nc; ++c) {  // transposed: [k][channel], unit stride over channels
        for (int64_t j = 0; j < width; ++j) wt[j * kBlock + c] = w_p[(c0 + c) * width + j];
        for (int64_t j = 0; j < kept; ++j) hist[j * kBlock + c] = seg.fresh[i] ? 0.0f : cache[(c0 + c) * kept + j];
      }
      // input(t) for t in [-(K-1), count): the cached history, then the segment's rows
      auto input = [&](int64_t t) -> const float* {
        return t < 0 ? hist.data() + (t + kept) * kBlock : x_p + (start + t) * x_stride + c0;
      };
      for (int64_t t = 0; t < count; ++t) {
        float* o = out_p + (start + t) * channels + c0;
        if (t + 4 < count) {  // input and output rows sit a row stride apart: no prefetcher sees them
          const float* next_in = x_p + (start + t + 4) * x_stride + c0;
          float* next_out = o + 4 * channels;
          for (int64_t c = 0; c < nc; c += 16) {  // one line per 16 channels; a write misses least when fetched early
            __builtin_prefetch(next_in + c, 0, 3);
            __builtin_prefetch(next_out + c, 1, 3);
          }
        }
        for (int64_t c = 0; c < nc; ++c) o[c] = b_p ? b_p[c0 + c] : 0.0f;
        for (int64_t j = 0; j < width; ++j) {
          const float* in = input(t - kept + j);
          const float* w = wt.data() + j * kBlock;
#pragma omp simd
          for (int64_t c = 0; c < nc; ++c) o[c] += w[c] * in[c];
        }
        silu_row(o, nullptr, o, nc);
      }
      for (int64_t j = 0; j < kept; ++j) {  // the new history: the last K-1 inputs
        const float* in = input(count - kept + j);
        for (int64_t c = 0; c < nc; ++c) cache[(c0 + c) * kept + j] = in[c];
      }
    }
  });
  return out;
}

// The SSM scan of prefill segments on the flat token rows, states in place, D skip included.
//   xbc [N, I + 2*G*N] (prefill_conv's output: x | B | C per row), dt_raw [N, H] (may be strided),
//   dt_bias / A / D [H], ssm_cache [S, H, P, N], y [N, H*P] (written at the segments' rows)
//   dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max) as MambaMixer._time_step
//   fresh [k] bool or None: a fresh segment starts from the zero state (its slot is not read)
//
// Tasks are (segment, head, half of the head's rows): a half state (32 x 128 fp32 = 16 KB at
// the bench shape) stays in L1 for the whole segment, and 2 x heads x segments tasks balance.
void prefill_scan(torch::Tensor xbc, torch::Tensor dt_raw, torch::Tensor dt_bias, torch::Tensor A, torch::Tensor D,
                  torch::Tensor ssm_cache, torch::Tensor starts, torch::Tensor counts, torch::Tensor slots,
                  double dt_min, double dt_max, torch::Tensor y, std::optional<torch::Tensor> fresh) {
  check_rows(xbc, "xbc");
  check_rows(dt_raw, "dt_raw");
  check_rows(y, "y");
  for (const auto& t : {dt_bias, A, D, ssm_cache}) {
    TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat32, "prefill_scan wants contiguous fp32 parameters and cache");
  }
  TORCH_CHECK(ssm_cache.dim() == 4, "ssm_cache [slots, heads, head_dim, d_state]");
  const int64_t rows = xbc.size(0), heads = ssm_cache.size(1), hdim = ssm_cache.size(2), dstate = ssm_cache.size(3);
  const int64_t inner = heads * hdim, groups = (xbc.size(1) - inner) / (2 * dstate);
  TORCH_CHECK(groups >= 1 && heads % groups == 0 && xbc.size(1) == inner + 2 * groups * dstate, "xbc columns");
  TORCH_CHECK(dt_raw.size(0) == rows && dt_raw.size(1) == heads && y.size(0) == rows && y.size(1) == inner, "dt / y shapes");
  TORCH_CHECK(dt_bias.numel() == heads && A.numel() == heads && D.numel() == heads, "one dt_bias, A, D per head");
  const Segments seg = read_segments(starts, counts, slots, fresh, rows, ssm_cache.size(0));
  const int64_t per_group = heads / groups, xs = xbc.stride(0), ds = dt_raw.stride(0), ys = y.stride(0);
  const float *x_p = xbc.data_ptr<float>(), *dt_p = dt_raw.data_ptr<float>(), *bias_p = dt_bias.data_ptr<float>();
  const float *a_p = A.data_ptr<float>(), *d_p = D.data_ptr<float>();
  float *cache_p = ssm_cache.data_ptr<float>(), *y_p = y.data_ptr<float>();
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  const int64_t halves = hdim >= 8 ? 2 : 1, half = (hdim / halves + 3) / 4 * 4;  // 4-row aligned split
  const int64_t k = static_cast<int64_t>(seg.start.size());
  // The time steps of every segment row and head first, into [segment rows, heads]: one pass
  // over the dt columns (a strided column of the in_proj output, a cache line per row), rather
  // than each (segment, head, half) task reading its column a line per token.
  std::vector<int64_t> first(k + 1, 0);  // segment i's rows in `steps`: first[i] .. first[i+1]-1
  for (int64_t i = 0; i < k; ++i) first[i + 1] = first[i] + seg.count[i];
  std::vector<float> steps(first[k] * heads);
  at::parallel_for(0, k, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t t = 0; t < seg.count[i]; ++t) {
        const float* raw = dt_p + (seg.start[i] + t) * ds;
        float* out = steps.data() + (first[i] + t) * heads;
        for (int64_t h = 0; h < heads; ++h) out[h] = std::min(std::max(softplus(raw[h] + bias_p[h]), lo), hi);
      }
    }
  });
  at::parallel_for(0, k * heads * halves, 1, [&](int64_t begin, int64_t end) {
    RunScratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / (heads * halves), h = (task / halves) % heads, part = task % halves;
      const int64_t g = h / per_group, start = seg.start[i], count = seg.count[i];
      const float* row0 = x_p + start * xs;
      const HeadRun run{steps.data() + first[i] * heads + h, heads, row0 + h * hdim, xs,
                        row0 + inner + g * dstate, row0 + inner + (groups + g) * dstate, xs,
                        y_p + start * ys + h * hdim, ys, a_p[h], d_p[h]};
      const int64_t p_begin = std::min(part * half, hdim), p_end = part + 1 == halves ? hdim : std::min(p_begin + half, hdim);
      scan_head_rows(run, cache_p + (seg.slot[i] * heads + h) * hdim * dstate, dstate, p_begin, p_end, count,
                     seg.fresh[i], scratch);
    }
  });
}

// Mamba2's output norm (GatedGroupRMSNorm): RMSNorm over groups of channels of x * silu(gate),
// times weight. x [N, D], gate [N, D] (rows may be strided: a column slice of the in_proj
// output, read in place), weight [D] -> out [N, D]; one pass per row, silu eight lanes wide.
torch::Tensor gated_rms_norm(torch::Tensor x, torch::Tensor gate, torch::Tensor weight, int64_t group_size, double eps) {
  check_rows(x, "x");
  check_rows(gate, "gate");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == torch::kFloat32, "weight must be contiguous fp32");
  const int64_t rows = x.size(0), size = x.size(1);
  TORCH_CHECK(gate.size(0) == rows && gate.size(1) == size && weight.numel() == size, "x / gate / weight shapes");
  TORCH_CHECK(group_size > 0 && size % group_size == 0, "group_size must divide the channels");
  auto out = torch::empty({rows, size}, x.options().memory_format(torch::MemoryFormat::Contiguous));
  const float *x_p = x.data_ptr<float>(), *g_p = gate.data_ptr<float>(), *w_p = weight.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  const int64_t xs = x.stride(0), gs = gate.stride(0);
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(size, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* o = out_p + r * size;
      silu_row(g_p + r * gs, x_p + r * xs, o, size);  // silu(gate) * x
      for (int64_t g0 = 0; g0 < size; g0 += group_size) {
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t c = g0; c < g0 + group_size; ++c) squares += o[c] * o[c];
        const float scale = 1.0f / std::sqrt(squares / static_cast<float>(group_size) + epsilon);
#pragma omp simd
        for (int64_t c = g0; c < g0 + group_size; ++c) o[c] = o[c] * scale * w_p[c];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("recurrent_scan", &recurrent_scan, "Mamba2 prefill scan as the recurrence, state kept in cache");
  m.def("prefill_conv", &prefill_conv, "causal depthwise conv + SiLU of prefill segments, conv states in place",
        py::arg("xbc"), py::arg("conv_cache"), py::arg("starts"), py::arg("counts"), py::arg("slots"), py::arg("weight"),
        py::arg("bias"), py::arg("fresh") = py::none());
  m.def("prefill_scan", &prefill_scan, "Mamba2 scan of prefill segments on flat rows, SSM states in place",
        py::arg("xbc"), py::arg("dt_raw"), py::arg("dt_bias"), py::arg("A"), py::arg("D"), py::arg("ssm_cache"),
        py::arg("starts"), py::arg("counts"), py::arg("slots"), py::arg("dt_min"), py::arg("dt_max"), py::arg("y"),
        py::arg("fresh") = py::none());
  m.def("gated_rms_norm", &gated_rms_norm, "Mamba2 output norm: grouped RMSNorm of x * silu(gate), times weight");
}
