// Weight matmuls on weights packed into 16-column panels: for few rows (decode) streaming each
// weight once at memory bandwidth, for many (prefill chunks, fp32) as a blocked GEMM near the
// FMA units' peak (the second half of this file).
// Built from source at start-up (workers/kernels/extensions.py); the tuning in
// workers/kernels/linear_tuning.py picks it per weight shape and row bucket only where it measures
// faster than F.linear and oneDNN, which stay the reference and the other choice.
//
// At 1-16 rows a linear is a pass over its weight: the arithmetic is small and what counts is
// reading the weight once, in order, with every loaded vector used by all the rows. So the
// weight [N, K] is packed once into panels of 16 output columns, k-major:
//
//     panels [ceil(N/16), K, 16]      panel j, step k = W[16j .. 16j+15, k]   (zero past N)
//
// and for each panel the rows' 16 outputs sit in registers (two 8-wide vectors per row) while
// k runs: one pass over the panel per group of up to kRowGroup rows (later groups re-read it
// from the caches: at few rows block by block from L1, see panel_all_rows). Threads take
// contiguous runs of panels, so each streams one region. The vector type is vector_math.h's vec8.
//
// Summation order: per output, k ascending in fp32 FMAs, like a plain dot product; results
// differ from MKL/oneDNN in the last bits (the fast path's documented tolerance), never in
// which rows or columns they cover.
//
// Int8 weights (the engine's weight-only int8 mode, `linear_tuning.quantize_int8`): the same
// panels with one signed byte per weight and a scale per output column (weight = scale * q).
// A k-step is then 16 bytes instead of 64, a quarter of the memory traffic; the bytes are
// widened to fp32 in registers and the scale applied once per output. With more rows than
// one group, each panel is widened once into an fp32 scratch panel (L1/L2) and the fp32 path
// runs on it, so the widening is not repeated per group.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vector_math.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

typedef signed char int8x8 __attribute__((vector_size(8)));
constexpr int64_t kPanel = 16;   // output columns per panel: two vec8 per row
constexpr int64_t kRowGroup = 6;  // rows whose accumulators (2 x 6 = 12 vectors) stay in registers
// Bytes ahead of the streaming read that the first group prefetches: 4 KB measured 0-10% faster
// than 0 or 1 KB at 4-16 rows; 2, 8 and 16 KB, and a prefetch into L2 instead of L1, no faster.
constexpr int64_t kPrefetchAhead = 4096;
constexpr int64_t kRowBlock = 48;  // rows per block (8 groups of 6): 48 x K fp32 stay in L2 (K up to ~4k)
// Up to kBlockedRows rows, a panel is taken kStepBlock k-steps (128 x 16 fp32 = 8 KB) at a time
// by every row group in turn (panel_all_rows). Measured (one thread, 238 MiB pass): 8 rows
// 10-20% faster than whole-panel passes, 4-16 rows no slower; at 24-48 rows whole-panel passes
// were 5-15% faster (the groups' compute dominates and the blocks' per-call work shows); there
// the later groups fetch the next panel instead (24-48 rows: 5-11% faster per thread; blocking
// 17-32 rows measured 8-13% slower again with 128-step blocks). 128 steps rather than 32: each
// block costs every group a reload and store of its accumulators and a mispredicted loop exit;
// 8 KB of panel and 16 rows x 512 B of x still fit L1. 64, 128 and 256 measured alike (within
// the +-5% noise of a shared machine).
constexpr int64_t kBlockedRows = 16;
constexpr int64_t kStepBlock = 128;

// One k-step of a panel as two vec8: fp32 as stored, int8 widened in registers (the scale is
// applied once per output at the end, not per product).
inline void load_step(const float* p, vec8& lo, vec8& hi) {
  lo = load8(p);
  hi = load8(p + 8);
}

inline void load_step(const int8_t* p, vec8& lo, vec8& hi) {
#if defined(__AVX2__)
  // GCC lowers the portable conversion below to scalar sign extensions (a byte at a time,
  // slower than reading fp32); AVX2 widens 8 bytes in one instruction.
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  std::memcpy(&lo, &a, sizeof(lo));
  std::memcpy(&hi, &b, sizeof(hi));
#else
  int8x8 a, b;
  std::memcpy(&a, p, sizeof(a));
  std::memcpy(&b, p + 8, sizeof(b));
  lo = __builtin_convertvector(a, vec8);
  hi = __builtin_convertvector(b, vec8);
#endif
}

// Lines a row group fetches into the caches while it runs: the line at ahead + k * kPanel for
// the steps k = phase, phase + every, ... (every: a multiple of the steps per line), while below
// `limit`, the end of the thread's run. Into L1 for what the group itself reads next, into L2
// for a later panel (it would push the current one out of L1).
template <typename T>
struct Prefetch {
  const T* ahead = nullptr;  // null: none
  const T* limit = nullptr;
  int64_t every = 1;
  int64_t phase = 0;
  bool to_l2 = false;
};

// Rows [0, R) of x times k-steps [k0, k1) of one panel, accumulating into acc (two vec8 per
// row, kept between blocks in an L1-resident tile), fetching what `pf` says meanwhile.
template <int R, typename T>
void panel_rows(const float* x, int64_t x_stride, const T* panel, int64_t k0, int64_t k1, vec8* acc,
                const Prefetch<T>& pf) {
  vec8 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = acc[2 * r];
    hi[r] = acc[2 * r + 1];
  }
  // The first step that fetches: k0 is 0 or a multiple of kStepBlock, itself a multiple of
  // `every` wherever blocks are taken (panel_all_rows), so no division is needed.
  int64_t fetch_at = pf.ahead ? k0 + pf.phase : k1;
  for (int64_t k = k0; k < k1; ++k) {
    if (k == fetch_at) {
      const T* line = pf.ahead + k * kPanel;
      if (line < pf.limit) {
        if (pf.to_l2) {
          __builtin_prefetch(line, 0, 2);
        } else {
          __builtin_prefetch(line, 0, 3);
        }
      }
      fetch_at += pf.every;
    }
    vec8 w0, w1;
    load_step(panel + k * kPanel, w0, w1);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * x_stride + k];
      lo[r] += xv * w0;
      hi[r] += xv * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    acc[2 * r] = lo[r];
    acc[2 * r + 1] = hi[r];
  }
}

template <typename T>
using PanelRowsFn = void (*)(const float*, int64_t, const T*, int64_t, int64_t, vec8*, const Prefetch<T>&);

template <typename T>
constexpr PanelRowsFn<T> kPanelRows[kRowGroup + 1] = {nullptr,          panel_rows<1, T>, panel_rows<2, T>,
                                                      panel_rows<3, T>, panel_rows<4, T>, panel_rows<5, T>,
                                                      panel_rows<6, T>};

// The rows of group g of `groups` over M rows, r of them in the groups before it. The first
// group, the one that streams the panel from memory, is a full kRowGroup (but 7 = 5 + 2: a
// group of one row has only 2 independent accumulator chains and leaves the FMA units waiting
// on their latency); the others are as even as possible (16 = 6 + 5 + 5, 32 = 6 + 5 x 4 + 6).
// Measured with the 128-step blocks against the earlier kernel (all groups as even as possible,
// 8 = 4 + 4, and 32-step blocks), one thread, 238 MiB pass, median of 31-41 paired runs: 8 rows
// 4-9% faster, 16 rows 1-3%, 32 rows 0-4%, 1-4 rows the same.
inline int64_t row_group(int64_t M, int64_t r, int64_t g, int64_t groups) {
  if (g == 0) return M == kRowGroup + 1 ? kRowGroup - 1 : std::min(kRowGroup, M);
  return (M - r) / (groups - g);
}

// All M (<= kRowBlock) rows of x times one panel, in row groups. The first group reads the
// panel from memory and prefetches kPrefetchAhead bytes ahead of it while below `limit`, the
// end of the thread's run. Up to kBlockedRows rows the panel is taken kStepBlock k-steps at a
// time and every group passes over that block while it is in L1, so the read from memory is
// spread over the whole panel's work instead of bunched into the first group's pass (the
// others then computing from L2 with the memory idle); the accumulators wait between blocks
// in `acc`, exactly as they were, so no bit changes. Beyond kBlockedRows each group passes
// over the whole panel, and the later groups, computing from the caches, share out the fetch
// of the next panel into L2 line by line, so the memory works while they compute and the next
// first group finds its panel near. Groups are row_group's. Each output sums its k in ascending
// order, whatever the blocking and the grouping.
template <typename T>
void panel_all_rows(const float* x, int64_t M, int64_t K, const T* panel, const float* scale, const float* bias,
                    float* out, int64_t N, int64_t width, const T* limit) {
  constexpr int64_t steps_per_line = kLine / (kPanel * sizeof(T));
  const int64_t groups = (M + kRowGroup - 1) / kRowGroup;
  const bool blocked = groups > 1 && M <= kBlockedRows;  // one group: nothing to interleave
  Prefetch<T> first;
  if (limit) first = {panel + kPrefetchAhead / static_cast<int64_t>(sizeof(T)), limit, steps_per_line, 0, false};
  vec8 acc[2 * kRowBlock];  // M <= kRowBlock: panel_linear passes row blocks of at most kRowBlock
  for (int64_t i = 0; i < 2 * M; ++i) acc[i] = vec8{};
  const int64_t step_block = blocked ? kStepBlock : K;
  for (int64_t k0 = 0; k0 < K; k0 += step_block) {
    const int64_t k1 = std::min(K, k0 + step_block);
    for (int64_t g = 0, r = 0; g < groups; ++g) {
      const int64_t rows = row_group(M, r, g, groups);
      Prefetch<T> pf;
      if (g == 0) {
        pf = first;
      } else if (!blocked && limit) {
        pf = {panel + K * kPanel, limit, steps_per_line * (groups - 1), steps_per_line * (g - 1), true};
      }
      kPanelRows<T>[rows](x + r * K, K, panel, k0, k1, acc + 2 * r, pf);
      r += rows;
    }
  }
  for (int64_t r = 0; r < M; ++r) {
    float row[kPanel];
    store8(row, acc[2 * r]);
    store8(row + 8, acc[2 * r + 1]);
    float* o = out + r * N;
    for (int64_t c = 0; c < width; ++c) {
      const float v = scale ? row[c] * scale[c] : row[c];
      o[c] = bias ? v + bias[c] : v;
    }
  }
}

// weight [N, K]  ->  panels [ceil(N/16), K, 16] of the same dtype, zero-padded past N.
template <typename T>
torch::Tensor pack(const torch::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto packed = torch::zeros({panels, K, kPanel}, w.options());
  const T* w_p = w.data_ptr<T>();
  T* p_p = packed.data_ptr<T>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t c = 0; c < kPanel && j * kPanel + c < N; ++c) {
        const T* src = w_p + (j * kPanel + c) * K;
        T* dst = p_p + j * K * kPanel + c;
        for (int64_t k = 0; k < K; ++k) dst[k * kPanel] = src[k];
      }
    }
  });
  return packed;
}

// One block of rows (x_p, M rows) times every panel, both threads taking contiguous runs of panels.
template <typename T>
void rows_times_panels(const float* x_p, int64_t M, int64_t K, const T* p_p, int64_t num_panels, int64_t N,
                       const float* s_p, const float* b_p, float* o_p) {
  // Enough panels per task that a thread streams a long run; few enough that both threads work.
  const int64_t grain = std::max<int64_t>(1, num_panels / (2 * at::get_num_threads()));
  at::parallel_for(0, num_panels, grain, [&](int64_t begin, int64_t end) {
    // int8 with more rows than one group: widen each panel once, then run the fp32 groups on it.
    const bool widen = !std::is_same<T, float>::value && M > kRowGroup;
    std::vector<float> widened(widen ? K * kPanel : 0);
    for (int64_t j = begin; j < end; ++j) {
      const int64_t col = j * kPanel, width = std::min(kPanel, N - col);
      const T* panel = p_p + j * K * kPanel;
      const T* limit = p_p + end * K * kPanel;  // the end of this thread's panels
      const float* scale = s_p ? s_p + col : nullptr;
      const float* bias = b_p ? b_p + col : nullptr;
      if (!widen) {
        panel_all_rows<T>(x_p, M, K, panel, scale, bias, o_p + col, N, width, limit);
        continue;
      }
      for (int64_t k = 0; k < K; ++k) {
        if (k % (kLine / kPanel) == 0) __builtin_prefetch(std::min(panel + k * kPanel + kPrefetchAhead, limit - 1), 0, 3);
        vec8 lo, hi;
        load_step(panel + k * kPanel, lo, hi);
        store8(widened.data() + k * kPanel, lo);
        store8(widened.data() + k * kPanel + 8, hi);
      }
      panel_all_rows<float>(x_p, M, K, widened.data(), scale, bias, o_p + col, N, width, nullptr);
    }
  });
}

// ---- Prompt-sized batches: beyond kRowBlock fp32 rows ----
//
// With many rows a linear is arithmetic, not a stream: the rows above re-read every panel once
// per block of 48 rows, and their broadcasts come from six rows kRowBlock apart in x. Here the
// loops are the classic blocked GEMM's instead: x is first copied into row strips of kRowGroup
// rows, k-major ([k][6], one contiguous 24-byte step per k), the strips of a row block sized
// to stay in L2 (kRowBlockBytes), and each panel is taken once per row block and run against
// every strip of it while it sits in L1/L2. The 6 x 16 tile of a strip times a panel lives in
// 12 registers through its k-steps, as in the rows above.
//
// Measured (2 threads, 1,024 rows, interleaved rounds, against the row-block path above and
// oneDNN's packed matmul): 3072x512 and 2576x512 (N large, K small) 167-189 GFLOPS against
// 134-171 and 140-160; 512x1024 and 512x1536 within noise of the path above (both ahead of
// oneDNN). A register-only FMA loop peaks at 190-204 GFLOPS on the same host.
//
// Bits: each output still sums its k ascending in one fp32 FMA chain (a tile's chain leaves
// its registers only between k-spans, stored and reloaded exactly), and the bias is added
// after the whole sum, so every row gets the same bits as on the row-block path, at any M.
constexpr int64_t kRowBlockBytes = 512 * 1024;  // a row block's strips: half of a 1 MB L2
// k-steps per span: the whole K up to here (spans measured no faster at K <= 1,536), beyond
// it equal spans, so a panel's span (16 x 2,048 fp32 = 128 KB) and a strip's stay in L2.
constexpr int64_t kMaxStepSpan = 2048;

// Rows [0, M) of x [M, K]  ->  strips [ceil(M/6), K, 6], rows past M zero.
void pack_row_strips(const float* x, int64_t M, int64_t K, float* strips) {
  const int64_t num_strips = (M + kRowGroup - 1) / kRowGroup;
  at::parallel_for(0, num_strips, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* strip = strips + i * K * kRowGroup;
      for (int64_t r = 0; r < kRowGroup; ++r) {
        const int64_t row = i * kRowGroup + r;
        if (row >= M) {
          for (int64_t k = 0; k < K; ++k) strip[k * kRowGroup + r] = 0.f;
          continue;
        }
        const float* src = x + row * K;
        for (int64_t k = 0; k < K; ++k) strip[k * kRowGroup + r] = src[k];
      }
    }
  });
}

// tile [6, 16] (row stride ldc) += strip [steps][6] times panel [steps][16]; kFirst: the tile
// starts from zero instead. bias (16 values, or null) is added after the sum: the last span's.
template <bool kFirst>
inline void strip_times_panel(const float* __restrict strip, const float* __restrict panel, int64_t steps,
                              const float* bias, float* tile, int64_t ldc) {
  vec8 lo[kRowGroup], hi[kRowGroup];
  for (int r = 0; r < kRowGroup; ++r) {
    lo[r] = kFirst ? vec8{} : load8(tile + r * ldc);
    hi[r] = kFirst ? vec8{} : load8(tile + r * ldc + 8);
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < steps; ++k) {
    const vec8 w0 = load8(panel + k * kPanel), w1 = load8(panel + k * kPanel + 8);
    for (int r = 0; r < kRowGroup; ++r) {
      const float xv = strip[k * kRowGroup + r];
      lo[r] += xv * w0;
      hi[r] += xv * w1;
    }
  }
  if (bias) {
    const vec8 b0 = load8(bias), b1 = load8(bias + 8);
    for (int r = 0; r < kRowGroup; ++r) {
      lo[r] += b0;
      hi[r] += b1;
    }
  }
  for (int r = 0; r < kRowGroup; ++r) {
    store8(tile + r * ldc, lo[r]);
    store8(tile + r * ldc + 8, hi[r]);
  }
}

// One strip times one panel over k-steps [k0, k0 + steps) into out's rows [row, row + rows)
// and columns [col, col + width). A full tile runs in place; a part one (the last strip's
// rows, the last panel's columns) through a 6 x 16 copy, so nothing is written past out.
void strip_tile(const float* strip, const float* panel, int64_t k0, int64_t steps, bool first, bool last,
                const float* b_p, float* out, int64_t N, int64_t row, int64_t rows, int64_t col, int64_t width) {
  const float* s = strip + k0 * kRowGroup;
  const float* p = panel + k0 * kPanel;
  float* at = out + row * N + col;
  if (rows == kRowGroup && width == kPanel) {
    const float* bias = last && b_p ? b_p + col : nullptr;
    first ? strip_times_panel<true>(s, p, steps, bias, at, N) : strip_times_panel<false>(s, p, steps, bias, at, N);
    return;
  }
  float tile[kRowGroup * kPanel] = {};
  float bias[kPanel] = {};
  for (int64_t c = 0; c < width && b_p; ++c) bias[c] = b_p[col + c];
  for (int64_t r = 0; r < rows && !first; ++r) std::memcpy(tile + r * kPanel, at + r * N, width * sizeof(float));
  const float* b = last && b_p ? bias : nullptr;
  first ? strip_times_panel<true>(s, p, steps, b, tile, kPanel) : strip_times_panel<false>(s, p, steps, b, tile, kPanel);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(at + r * N, tile + r * kPanel, width * sizeof(float));
}

// x [M, K] (M > kRowBlock) times every fp32 panel into out [M, N]: strips packed once, then
// each thread takes a contiguous run of panels, and for each k-span and row block of strips
// runs every one of its panels against every strip of the block.
void many_rows_times_panels(const float* x_p, int64_t M, int64_t K, const float* p_p, int64_t num_panels, int64_t N,
                            const float* b_p, float* o_p) {
  const int64_t num_strips = (M + kRowGroup - 1) / kRowGroup;
  std::unique_ptr<float[]> strips(new float[num_strips * K * kRowGroup]);  // uninitialised: all written
  pack_row_strips(x_p, M, K, strips.get());
  const int64_t spans = (K + kMaxStepSpan - 1) / kMaxStepSpan;
  const int64_t span = (K + spans - 1) / spans;
  const int64_t strips_per_block = std::max<int64_t>(1, kRowBlockBytes / (span * kRowGroup * sizeof(float)));
  const int64_t grain = std::max<int64_t>(1, num_panels / at::get_num_threads());
  at::parallel_for(0, num_panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t k0 = 0; k0 < K; k0 += span) {
      const int64_t steps = std::min(span, K - k0);
      const bool first = k0 == 0, last = k0 + steps == K;
      for (int64_t i0 = 0; i0 < num_strips; i0 += strips_per_block) {
        const int64_t i1 = std::min(num_strips, i0 + strips_per_block);
        for (int64_t j = begin; j < end; ++j) {
          const float* panel = p_p + j * K * kPanel;
          const int64_t col = j * kPanel, width = std::min(kPanel, N - col);
          for (int64_t i = i0; i < i1; ++i) {
            const int64_t row = i * kRowGroup, rows = std::min(kRowGroup, M - row);
            strip_tile(strips.get() + i * K * kRowGroup, panel, k0, steps, first, last, b_p, o_p, N, row, rows, col,
                       width);
          }
        }
      }
    }
  });
}

}  // namespace

// weight [N, K] fp32 or int8  ->  panels [ceil(N/16), K, 16] of the same dtype, zero-padded past N.
torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_panels wants a 2-d weight");
  auto w = weight.contiguous();
  if (w.scalar_type() == torch::kInt8) return pack<int8_t>(w);
  TORCH_CHECK(w.scalar_type() == torch::kFloat32, "pack_panels wants an fp32 or int8 weight");
  return pack<float>(w);
}

// x [..., K] fp32, panels from pack_panels, out_features N, bias [N] or None, and for int8
// panels the per-output scales [N] (weight = scale * int8)  ->  [..., N] fp32.
// N is not recorded in the panels (only ceil(N/16) is): callers pass the N they packed.
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                           c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> scales) {
  const bool int8 = panels.scalar_type() == torch::kInt8;
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && (int8 || panels.scalar_type() == torch::kFloat32),
              "panel_linear wants fp32 inputs and fp32 or int8 panels");
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "panel_linear runs on CPU tensors only");
  TORCH_CHECK(panels.is_contiguous() && panels.dim() == 3 && panels.size(2) == kPanel,
              "panel_linear: panels must be a contiguous [ceil(N/16), K, 16] tensor from pack_panels");
  const int64_t K = panels.size(1), N = out_features, num_panels = panels.size(0);
  TORCH_CHECK(K > 0 && N > 0, "panel_linear: empty weight (K = ", K, ", N = ", N, ")");
  TORCH_CHECK(x.size(-1) == K, "panel_linear: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(num_panels == (N + kPanel - 1) / kPanel, "panel_linear: panels do not match out_features");
  TORCH_CHECK(int8 == scales.has_value(), "panel_linear: int8 panels need their scales, fp32 panels have none");
  auto xc = x.contiguous();
  const int64_t M = xc.numel() / K;
  auto out_sizes = xc.sizes().vec();
  out_sizes.back() = N;
  auto out = torch::empty(out_sizes, xc.options());
  torch::Tensor bc, sc;
  if (bias.has_value()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.device().is_cpu() && bc.scalar_type() == torch::kFloat32 && bc.numel() == N,
                "panel_linear: bias must be a CPU fp32 [N]");
  }
  if (int8) {
    sc = scales->contiguous();
    TORCH_CHECK(sc.device().is_cpu() && sc.scalar_type() == torch::kFloat32 && sc.numel() == N,
                "panel_linear: scales must be a CPU fp32 [N]");
  }
  const float* x_p = xc.data_ptr<float>();
  const float* b_p = bc.defined() ? bc.data_ptr<float>() : nullptr;
  const float* s_p = sc.defined() ? sc.data_ptr<float>() : nullptr;
  float* o_p = out.data_ptr<float>();
  if (!int8 && M > kRowBlock) {
    many_rows_times_panels(x_p, M, K, panels.data_ptr<float>(), num_panels, N, b_p, o_p);
    return out;
  }
  // Otherwise (few rows, or int8 weights at any count) blocks of kRowBlock rows, one after the
  // other: each block's rows stay in L2 while every panel passes over them (without it a
  // 2,048-row int8 prefill would re-read all of x from memory once per panel). Each row's
  // arithmetic is the same at any M, so blocking changes no bit.
  for (int64_t r = 0; r < M; r += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, M - r);
    if (int8) {
      rows_times_panels<int8_t>(x_p + r * K, rows, K, panels.data_ptr<int8_t>(), num_panels, N, s_p, b_p, o_p + r * N);
    } else {
      rows_times_panels<float>(x_p + r * K, rows, K, panels.data_ptr<float>(), num_panels, N, s_p, b_p, o_p + r * N);
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_panels", &pack_panels, "pack a [N, K] fp32 or int8 weight into [ceil(N/16), K, 16] panels");
  m.def("panel_linear", &panel_linear, "x @ W.T (+ bias) over packed panels (int8: times per-output scales)",
        py::arg("x"), py::arg("panels"), py::arg("out_features"), py::arg("bias"), py::arg("scales") = py::none());
}
