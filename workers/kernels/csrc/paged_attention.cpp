// Paged decode attention (one query token per sequence over its K/V blocks, read in place by
// block table), a source of the decode module: decode_kernels.cpp binds it as
// `paged_decode_attention` (`Attention._decode_paged`). Its pure-torch reference is
// `Attention._decode` (the history gathered into padded tensors, masked SDPA); the tests hold
// them equal.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "decode_kernels.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

// exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln 2 / 2, exp(r) by Cephes' degree-6
// polynomial (about 1 ulp). Unlike std::exp it has no call and no errno, so loops over it
// vectorise (8 lanes with AVX2): the softmax runs it on whole rows (silu: `silu_row`).
inline float fast_exp(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.3f ? 88.3f : x);  // 2^n stays a normal float, never inf (selects, not branches)
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 in two parts: exact n * hi
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline float lane_sum(vec8 v) {
  float l[8];
  store8(l, v);
  return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
}

// The eight lane sums of v[0..7], in one vector: [sum v0, sum v1, ..., sum v7].
inline vec8 lane_sums(const vec8* v) {
#if defined(__AVX__)
  const __m256 t0 = _mm256_hadd_ps((__m256)v[0], (__m256)v[1]), t1 = _mm256_hadd_ps((__m256)v[2], (__m256)v[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)v[4], (__m256)v[5]), t3 = _mm256_hadd_ps((__m256)v[6], (__m256)v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // low / high halves' sums of v0-3, v4-7
  return (vec8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  vec8 out;
  for (int i = 0; i < 8; ++i) out[i] = lane_sum(v[i]);
  return out;
#endif
}

constexpr int64_t kKeyChunk = 64;  // keys per online-softmax update: their scores, weights and pointers stay in L1

// Scores of two keys for G (<= 4) query heads: each loaded key vector serves all G heads, and
// the 2 x G dot products are independent chains (8 lanes each, summed at the end).
template <int G>
void score_pair(const float* q, int64_t dim, const float* k0, const float* k1, float scale, float* s, int64_t s_stride,
                int64_t t) {
  const int64_t body = dim - dim % 8;
  vec8 a[G], b[G];
  for (int g = 0; g < G; ++g) a[g] = b[g] = vec8{};
  for (int64_t e = 0; e < body; e += 8) {
    const vec8 x0 = load8(k0 + e), x1 = load8(k1 + e);
    for (int g = 0; g < G; ++g) {
      const vec8 qv = load8(q + g * dim + e);
      a[g] += qv * x0;
      b[g] += qv * x1;
    }
  }
  if (G == 4 && body == dim) {  // the usual grouped-query shape: all eight sums in one reduction
    const vec8 parts[8] = {a[0], b[0], a[1 % G], b[1 % G], a[2 % G], b[2 % G], a[3 % G], b[3 % G]};
    const vec8 dots = lane_sums(parts) * scale;
    for (int g = 0; g < G; ++g) {
      s[g * s_stride + t] = dots[2 * g];
      s[g * s_stride + t + 1] = dots[2 * g + 1];
    }
    return;
  }
  for (int g = 0; g < G; ++g) {
    float d0 = lane_sum(a[g]), d1 = lane_sum(b[g]);
    for (int64_t e = body; e < dim; ++e) {
      d0 += q[g * dim + e] * k0[e];
      d1 += q[g * dim + e] * k1[e];
    }
    s[g * s_stride + t] = d0 * scale;
    s[g * s_stride + t + 1] = d1 * scale;
  }
}

template <int G>
void score_one(const float* q, int64_t dim, const float* k0, float scale, float* s, int64_t s_stride, int64_t t) {
  const int64_t body = dim - dim % 8;
  vec8 a[G];
  for (int g = 0; g < G; ++g) a[g] = vec8{};
  for (int64_t e = 0; e < body; e += 8) {
    const vec8 x0 = load8(k0 + e);
    for (int g = 0; g < G; ++g) a[g] += load8(q + g * dim + e) * x0;
  }
  for (int g = 0; g < G; ++g) {
    float d0 = lane_sum(a[g]);
    for (int64_t e = body; e < dim; ++e) d0 += q[g * dim + e] * k0[e];
    s[g * s_stride + t] = d0 * scale;
  }
}

// The K and V rows of a task's next chunk, fetched into L2 a few lines at a time while the
// current chunk is scored: spread over the compute, the misses overlap it; issued in one burst
// at the chunk's start they stalled the core until most had arrived (memory, then compute).
struct NextChunk {
  const float* rows[2 * kKeyChunk];  // K rows, then V rows (filled by the caller before start())
  int64_t lines = 0;                 // lines to fetch in all: rows x lines_per_row
  int64_t lines_per_row = 1;
  int64_t cursor = 0;                // the next line to fetch
  int64_t per_call = 0;              // lines per fetch() call

  // `count` rows of `row_floats` each, spread evenly over `calls` calls of fetch().
  void start(int64_t count, int64_t row_floats, int64_t calls) {
    lines_per_row = (row_floats * static_cast<int64_t>(sizeof(float)) + kLine - 1) / kLine;
    lines = count * lines_per_row;
    cursor = 0;
    per_call = (lines + calls - 1) / calls;
  }

  void fetch() {
    for (int64_t end = std::min(lines, cursor + per_call); cursor < end; ++cursor) {
      __builtin_prefetch(rows[cursor / lines_per_row] + (cursor % lines_per_row) * (kLine / sizeof(float)), 0, 2);
    }
  }
};

// scores[j][t] = scale * q_j . key_t for the chunk's n keys and the nj query heads of one kv head.
void chunk_scores(const float* q, int64_t nj, int64_t dim, const float* const* keys, int64_t offset, int64_t n,
                  float scale, float* scores, NextChunk& ahead) {
  for (int64_t j0 = 0; j0 < nj; j0 += 4) {
    const int64_t g = std::min<int64_t>(4, nj - j0);
    const float* qg = q + j0 * dim;
    float* sg = scores + j0 * kKeyChunk;
    int64_t t = 0;
    for (; t + 1 < n; t += 2) {
      ahead.fetch();
      switch (g) {
        case 1: score_pair<1>(qg, dim, keys[t] + offset, keys[t + 1] + offset, scale, sg, kKeyChunk, t); break;
        case 2: score_pair<2>(qg, dim, keys[t] + offset, keys[t + 1] + offset, scale, sg, kKeyChunk, t); break;
        case 3: score_pair<3>(qg, dim, keys[t] + offset, keys[t + 1] + offset, scale, sg, kKeyChunk, t); break;
        default: score_pair<4>(qg, dim, keys[t] + offset, keys[t + 1] + offset, scale, sg, kKeyChunk, t); break;
      }
    }
    if (t < n) {
      switch (g) {
        case 1: score_one<1>(qg, dim, keys[t] + offset, scale, sg, kKeyChunk, t); break;
        case 2: score_one<2>(qg, dim, keys[t] + offset, scale, sg, kKeyChunk, t); break;
        case 3: score_one<3>(qg, dim, keys[t] + offset, scale, sg, kKeyChunk, t); break;
        default: score_one<4>(qg, dim, keys[t] + offset, scale, sg, kKeyChunk, t); break;
      }
    }
  }
}

// acc_j += sum_t w[j][t] * value_t. A run of up to 8 of acc_j's vectors stays in registers over
// all the chunk's keys (one FMA chain per vector, in key order), so the accumulator is loaded
// and stored once per chunk instead of once per few keys: the store-to-load round trip, not the
// FMAs, bounded the loop that kept it in memory.
template <int NV>
void values_run(const float* wj, const float* const* values, int64_t offset, int64_t n, float* a) {
  vec8 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = load8(a + 8 * v);
  for (int64_t t = 0; t < n; ++t) {
    const vec8 w = vec8{} + wj[t];
    const float* row = values[t] + offset;
    for (int v = 0; v < NV; ++v) acc[v] = fmadd(w, load8(row + 8 * v), acc[v]);
  }
  for (int v = 0; v < NV; ++v) store8(a + 8 * v, acc[v]);
}

// The same sums for 4 query heads at once, 16 channels at a time: each loaded slice of a value
// row serves all 4 heads (2 loads and 4 broadcasts per 8 FMAs, where values_run per head
// needs 8 loads per 8), each accumulator still one FMA chain in key order: the same bits.
void values_4_heads(const float* w, const float* const* values, int64_t offset, int64_t n, int64_t dim, float* acc) {
  for (int64_t e = 0; e < dim; e += 16) {
    vec8 a[4][2];
    for (int j = 0; j < 4; ++j) {
      a[j][0] = load8(acc + j * dim + e);
      a[j][1] = load8(acc + j * dim + e + 8);
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* row = values[t] + offset + e;
      const vec8 v0 = load8(row), v1 = load8(row + 8);
      for (int j = 0; j < 4; ++j) {
        const vec8 wj = vec8{} + w[j * kKeyChunk + t];
        a[j][0] = fmadd(wj, v0, a[j][0]);
        a[j][1] = fmadd(wj, v1, a[j][1]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      store8(acc + j * dim + e, a[j][0]);
      store8(acc + j * dim + e + 8, a[j][1]);
    }
  }
}

void chunk_values(const float* w, int64_t nj, int64_t dim, const float* const* values, int64_t offset, int64_t n,
                  float* acc) {
  const int64_t body = dim - dim % 8;
  int64_t j = 0;
  if (dim % 16 == 0) {
    for (; j + 4 <= nj; j += 4) values_4_heads(w + j * kKeyChunk, values, offset, n, dim, acc + j * dim);
  }
  for (; j < nj; ++j) {
    const float* wj = w + j * kKeyChunk;
    float* a = acc + j * dim;
    for (int64_t e = 0; e < body; e += 64) {
      switch (std::min<int64_t>(8, (body - e) / 8)) {
        case 1: values_run<1>(wj, values, offset + e, n, a + e); break;
        case 2: values_run<2>(wj, values, offset + e, n, a + e); break;
        case 3: values_run<3>(wj, values, offset + e, n, a + e); break;
        case 4: values_run<4>(wj, values, offset + e, n, a + e); break;
        case 5: values_run<5>(wj, values, offset + e, n, a + e); break;
        case 6: values_run<6>(wj, values, offset + e, n, a + e); break;
        case 7: values_run<7>(wj, values, offset + e, n, a + e); break;
        default: values_run<8>(wj, values, offset + e, n, a + e); break;
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = body; e < dim; ++e) a[e] = fmadd(wj[t], values[t][offset + e], a[e]);
    }
  }
}

// Online softmax over one chunk's scores: the running maximum per head, the accumulator and
// total rescaled when it grows, scores turned into weights in place.
void chunk_softmax(float* scores, int64_t nj, int64_t n, float* acc, int64_t dim, float* best, float* total) {
  for (int64_t j = 0; j < nj; ++j) {
    float* s = scores + j * kKeyChunk;
    float top = s[0];
    for (int64_t t = 1; t < n; ++t) top = std::max(top, s[t]);
    if (top > best[j]) {
      const float r = std::exp(best[j] - top);
      total[j] *= r;
      float* a = acc + j * dim;
#pragma omp simd
      for (int64_t e = 0; e < dim; ++e) a[e] *= r;
      best[j] = top;
    }
    const float m = best[j];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = fast_exp(s[t] - m);
      sum += s[t];
    }
    total[j] += sum;
  }
}

}  // namespace

// Attention of one query token per sequence over its paged K/V, read in place by block table.
//   q [B, Hq, d]; k_cache/v_cache [num_blocks, block_size, Hkv, d]; block_tables [B, max_blocks];
//   num_keys [B] (keys 0..num_keys-1 are visible)  ->  out [B, Hq, d]
// With k_new/v_new [B, Hkv, d] and kv_slots [B] (block * block_size + offset), each sequence's
// new key and value are first written to its slot (which the attention then reads).
// q, k_new, v_new may be views with any row stride (channels contiguous).
//
// Online softmax kKeyChunk keys at a time, whatever blocks they sit in: the chunk's scores
// (`chunk_scores`), its maximum, one rescale of the accumulator when the maximum grows, its
// weights in one vectorised exp (`chunk_softmax`), then the weighted values (`chunk_values`).
// The chunk's keys are fetched into the caches as their addresses are worked out (a kv head's
// piece of them at a time), so the misses of a chunk overlap instead of following one another;
// the next chunk's K and V rows are fetched into L2 a few lines per scored key pair
// (`NextChunk`), so memory works while this chunk computes. With four query heads per kv head
// each value row is loaded once for all four (`values_4_heads`). Measured against the kernel
// without both (8 sequences x 8k keys in 16-token blocks, 4 layers, 2 threads, 40 interleaved
// calls, medians): 33.5 -> 24.1 ms from the fetch ahead, 30.3 -> 27.1 ms from the shared value
// loads in a later, noisier run (41.9 ms for the old kernel in that run); the same bits.
// When the sequences share out evenly, two or more per thread, a task takes all kv heads of a
// sequence, so the pieces of each K/V row are all used within one task; otherwise a task per
// (sequence, kv head) keeps the threads evenly busy. Measured (8 sequences x 8k keys,
// 4 layers, one thread): 83 -> 39-43 ms against attend-one-block-at-a-time.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor num_keys, double scale,
                                     c10::optional<torch::Tensor> k_new, c10::optional<torch::Tensor> v_new,
                                     c10::optional<torch::Tensor> kv_slots) {
  check_fp32(q, "q");
  check_fp32(k_cache, "k_cache");
  check_fp32(v_cache, "v_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [B, H, d], heads packed");
  const int64_t batch = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), per_kv = q_heads / kv_heads;
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.size(3) == dim,
              "k_cache/v_cache must be [num_blocks, block_size, Hkv, d] with q's d");
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "query heads must be a multiple of kv heads");
  const bool append = k_new.has_value();
  TORCH_CHECK(append == v_new.has_value() && append == kv_slots.has_value());
  auto tables = block_tables.contiguous().to(torch::kLong);
  auto lens = num_keys.contiguous().to(torch::kLong);
  auto out = torch::empty({batch, q_heads, dim}, q.options());
  const int64_t width = tables.size(1), q_stride = q.stride(0);
  const int64_t* table_p = tables.data_ptr<int64_t>();
  const int64_t* len_p = lens.data_ptr<int64_t>();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && lens.numel() == batch,
              "block_tables must be [B, max_blocks] and num_keys [B]");
  for (int64_t b = 0; b < batch; ++b) {  // every key read lies in a block of the cache
    TORCH_CHECK(len_p[b] >= 0 && len_p[b] <= width * block_size, "num_keys[", b, "] = ", len_p[b], " beyond its block table");
    for (int64_t i = 0; i < (len_p[b] + block_size - 1) / block_size; ++i) {
      const int64_t block = table_p[b * width + i];
      TORCH_CHECK(block >= 0 && block < k_cache.size(0), "block_tables[", b, "] names block ", block, " of ", k_cache.size(0));
    }
  }
  const float* q_p = q.data_ptr<float>();
  float *k_p = k_cache.data_ptr<float>(), *v_p = v_cache.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t token_stride = kv_heads * dim;

  torch::Tensor slot;
  const float *kn_p = nullptr, *vn_p = nullptr;
  const int64_t* slot_p = nullptr;
  int64_t kn_stride = 0, vn_stride = 0;
  if (append) {
    for (const auto& t : {*k_new, *v_new}) {
      check_fp32(t, "k_new/v_new");
      TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == dim && t.size(0) == batch && t.size(1) == kv_heads);
    }
    slot = kv_slots->contiguous().to(torch::kLong);
    TORCH_CHECK(slot.numel() == batch);
    slot_p = slot.data_ptr<int64_t>();
    kn_p = k_new->data_ptr<float>();
    vn_p = v_new->data_ptr<float>();
    kn_stride = k_new->stride(0);
    vn_stride = v_new->stride(0);
  }

  // A task is one sequence's kv heads: all of them when the sequences share out evenly over the
  // threads, two or more each (a chunk's K/V rows [Hkv, d] are then all used within the task,
  // where one kv head per task reads every Hkv-th piece of each row), else one kv head.
  const int64_t threads = at::get_num_threads();
  const int64_t task_heads = batch >= 2 * threads && batch % threads == 0 ? kv_heads : 1;
  const int64_t tasks_per_seq = kv_heads / task_heads;
  at::parallel_for(0, batch * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    const int64_t nq = task_heads * per_kv;
    std::vector<float> acc(nq * dim), best(nq), total(nq), score(per_kv * kKeyChunk);
    const float* key_at[kKeyChunk];
    const float* value_at[kKeyChunk];
    NextChunk ahead;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / tasks_per_seq, h0 = (i % tasks_per_seq) * task_heads;
      if (append) {  // this task's own slice of its sequence's slot: no other task touches it
        const int64_t offset = slot_p[b] * token_stride + h0 * dim;
        std::memcpy(k_p + offset, kn_p + b * kn_stride + h0 * dim, task_heads * dim * sizeof(float));
        std::memcpy(v_p + offset, vn_p + b * vn_stride + h0 * dim, task_heads * dim * sizeof(float));
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(best.begin(), best.end(), -std::numeric_limits<float>::infinity());
      std::fill(total.begin(), total.end(), 0.0f);
      const int64_t keys = len_p[b];
      // Where key `pos` of this sequence sits (its block, then its row), from this task's first head.
      auto row_at = [&](int64_t pos) {
        return (table_p[b * width + pos / block_size] * block_size + pos % block_size) * token_stride + h0 * dim;
      };
      for (int64_t start = 0; start < keys; start += kKeyChunk) {
        const int64_t n = std::min(kKeyChunk, keys - start);
        for (int64_t t = 0; t < n; ++t) {
          const int64_t at = row_at(start + t);
          key_at[t] = k_p + at;
          value_at[t] = v_p + at;
          for (int64_t e = 0; e < dim; e += 16) __builtin_prefetch(key_at[t] + e, 0, 3);
        }
        const int64_t next = std::min(kKeyChunk, keys - start - n);  // keys of the next chunk
        for (int64_t t = 0; t < next; ++t) {
          const int64_t at = row_at(start + n + t);
          ahead.rows[t] = k_p + at;
          ahead.rows[next + t] = v_p + at;
        }
        ahead.start(2 * next, task_heads * dim, task_heads * ((per_kv + 3) / 4) * (kKeyChunk / 2));
        for (int64_t h = 0; h < task_heads; ++h) {
          if (h + 1 < task_heads) {  // the next kv head's keys of the chunk, while this one is scored (L1-sized bursts)
            for (int64_t t = 0; t < n; ++t) {
              for (int64_t e = 0; e < dim; e += 16) __builtin_prefetch(key_at[t] + (h + 1) * dim + e, 0, 3);
            }
          }
          const int64_t j0 = h * per_kv;
          chunk_scores(q_p + b * q_stride + (h0 + h) * per_kv * dim, per_kv, dim, key_at, h * dim, n, sc, score.data(), ahead);
          chunk_softmax(score.data(), per_kv, n, acc.data() + j0 * dim, dim, best.data() + j0, total.data() + j0);
          chunk_values(score.data(), per_kv, dim, value_at, h * dim, n, acc.data() + j0 * dim);
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        float* o = out_p + (b * q_heads + h0 * per_kv + j) * dim;
        const float inv = total[j] > 0.0f ? 1.0f / total[j] : 0.0f;
        for (int64_t e = 0; e < dim; ++e) o[e] = acc[j * dim + e] * inv;
      }
    }
  });
  return out;
}
