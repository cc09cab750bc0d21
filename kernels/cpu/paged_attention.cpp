// Paged attention on CPU, reading K/V from the cache blocks in place (no gather).
//
// The batch and cache contract is kernels/__init__.py's: caches [num_kv_heads, num_blocks, block_size,
// head_dim]; request r owns query rows query_start_loc[r]:query_start_loc[r+1], its last one at position
// seq_lens[r] - 1, each row attending causally to keys 0..its position, or with a sliding window W to the last W of
// them (keys position - W + 1..position, its own included, as Hugging Face's models do). With a logit soft-cap c,
// each score s (after the scale) becomes c * tanh(s / c) before the softmax (Gemma 2). With attention sinks
// (gpt-oss), head h's sinks[h] is one more logit in its softmax's denominator that attends to no value: it joins the
// sum where each output row is normalized, out = acc / (sum + exp(sink - max)).
//
// A work item reads only the keys its rows' windows hold: blocks wholly before them are never read (they may
// already hold another request's tokens), so a decode costs its window, not its context.
//
// One work item is (request, kv head, tile of query rows): the kv head's query heads are handled together, so each
// K/V row is converted once for all of them. Keys are split at fixed positions, every kKeyChunk keys: a query's
// output is computed chunk by chunk (each chunk's scores, max, sum of exponentials and unnormalized output, in key
// order), then the chunks are merged in order. Whether a query is a decode or a prefill row, alone or in a batch,
// whether its keys were written this step or long ago, and whichever thread runs it, it is computed by the same
// operations in the same order, so its output is the same bit for bit (batch invariance). Items are split among
// torch's threads by cost; a batch of fewer items than kMinItems (one request's few KV heads: a decode, or a few
// rows over a long prefix) runs each chunk of a long item as a part of its own, so that two threads share even
// three KV heads; the parts' sums are merged as an item's own chunks are.
//
// The cache may hold another dtype than the query (--kv-cache-dtype: bfloat16, float16, fp8_e4m3, fp8_e5m2): each
// K/V row is converted to float32 as it is read. reshape_and_cache copies rows of the cache's dtype: the caller
// converts them (kernels/reference.py's to_cache_dtype).

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include "convert.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kItemOverhead = 32;  // fixed cost of an item, in keys, for balancing
constexpr int64_t kMaxTileRows = 64;   // a prefill tile's query rows: enough to amortize its gather
constexpr int64_t kMinItems = 8;       // fewer items than this run their chunks as parts
constexpr int64_t kKeyChunk = 256;     // keys are split at multiples of this, whatever the batch
constexpr int64_t kKeyBlock = 32;      // keys a block of the loops over queries (the results do not depend on it)
constexpr int64_t kScoreStride = kKeyChunk + 16;  // floats between queries' scores: rows 1 KiB apart share L1 sets
constexpr int64_t kMinBlockQueries = 16;  // queries sharing a block's keys that pay for the block ways (below)
constexpr int kBlockQueries = 4;          // queries a pass of scores_of_block

// Keeps a loaded vector in a register. Without this GCC folds a load that several multiply-adds use into each of
// them as a memory operand, and on AVX2 the loads, not the multiply-adds, bound the loop (measured there only).
template <typename V>
inline void in_register(V& v) {
#if defined(CPU_CAPABILITY_AVX2)
  __asm__("" : "+x"(v));
#endif
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += w * x
inline void axpy(float w, const float* x, float* y, int64_t n) {
  const Vec wv(w);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size())
    at::vec::fmadd(wv, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += w * x[i];
}

#if defined(CPU_CAPABILITY_AVX2)
// Eight sums at once, lane r holding a[r]'s, each summed as vec_reduce_all sums one vector on AVX2:
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). One reduction of eight vectors where vec_reduce_all is one each.
inline __m256 reduce8(const __m256* a) {
  __m256 b[4];
  for (int p = 0; p < 4; ++p) {  // [a[2p]'s m0..m3 | a[2p+1]'s], m_i = l_i + l_(i+4), reordered m0 m2 m1 m3
    const __m256 lo = _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20);
    const __m256 hi = _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31);
    b[p] = _mm256_permute_ps(_mm256_add_ps(lo, hi), 0xD8);
  }
  // hadd per 128-bit half: [x0 + x1, x2 + x3, y0 + y1, y2 + y3]. Then halves [a0 a2 a4 a6 | a1 a3 a5 a7].
  const __m256 d = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
  return _mm256_permutevar8x32_ps(d, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

// A query's scores and weighted values over n keys, where head_dim is NV whole vectors: each score is dot()'s
// operations, and each output element axpy()'s, in the same order, so the results are the same bit for bit; only
// the scheduling differs. Eight keys' dot products run side by side (one alone is a chain of dependent
// multiply-adds), a last group of fewer keys repeating its last key in the spare chains; the weighted sum keeps its
// accumulators in registers across the keys instead of loading and storing them for every key. On AVX2 the eight
// dot products are reduced together (reduce8), and two queries that see the same keys share each key row's loads
// (scores_of_two).
template <int NV>
void scores_of(const float* q, const float* const* keys, int64_t n, float* scores) {
  constexpr int kKeys = 8;
  for (int64_t j = 0; j < n; j += kKeys) {
    const float* k[kKeys];
    for (int r = 0; r < kKeys; ++r) k[r] = keys[std::min<int64_t>(j + r, n - 1)];
    Vec acc[kKeys];
    for (int r = 0; r < kKeys; ++r) acc[r] = Vec(0.f);
    for (int v = 0; v < NV; ++v) {
      Vec qv = Vec::loadu(q + v * Vec::size());
      in_register(qv);
      for (int r = 0; r < kKeys; ++r) acc[r] = at::vec::fmadd(qv, Vec::loadu(k[r] + v * Vec::size()), acc[r]);
    }
#if defined(CPU_CAPABILITY_AVX2)
    __m256 a[kKeys];
    for (int r = 0; r < kKeys; ++r) a[r] = acc[r];
    alignas(32) float dots[kKeys];
    _mm256_store_ps(dots, reduce8(a));
#else
    float dots[kKeys];
    auto add = [](Vec& x, Vec& y) { return x + y; };
    for (int r = 0; r < kKeys; ++r) dots[r] = at::vec::vec_reduce_all<float>(add, acc[r]);
#endif
    std::copy_n(dots, std::min<int64_t>(kKeys, n - j), scores + j);
  }
}

// out[offset..offset + W vectors) += sum over keys j of w[j] * values[j][same], accumulated in key order.
template <int W>
inline void weighted_strip(const float* w, const float* const* values, int64_t n, int64_t offset, float* out) {
  Vec acc[W];
  for (int i = 0; i < W; ++i) acc[i] = Vec::loadu(out + offset + i * Vec::size());
  for (int64_t j = 0; j < n; ++j) {
    const Vec wj(w[j]);
    for (int i = 0; i < W; ++i) acc[i] = at::vec::fmadd(wj, Vec::loadu(values[j] + offset + i * Vec::size()), acc[i]);
  }
  for (int i = 0; i < W; ++i) acc[i].store(out + offset + i * Vec::size());
}

template <int NV>
void weighted_sum(const float* w, const float* const* values, int64_t n, float* out) {
  constexpr int kStrip = 8;  // accumulators a strip: with the weight and a load, within 16 vector registers
  for (int s = 0; s + kStrip <= NV; s += kStrip) weighted_strip<kStrip>(w, values, n, s * Vec::size(), out);
  if constexpr (NV % kStrip != 0) weighted_strip<NV % kStrip>(w, values, n, NV / kStrip * kStrip * Vec::size(), out);
}

#if defined(CPU_CAPABILITY_AVX2)
// Two queries' scores over the same n keys, four keys at a time: each key row is loaded once for both, and the
// eight dot products are reduced together. Each score is dot()'s operations in dot()'s order.
template <int NV>
void scores_of_two(const float* q0, const float* q1, const float* const* keys, int64_t n, float* s0, float* s1) {
  for (int64_t j = 0; j < n; j += 4) {
    const float* k[4];
    for (int r = 0; r < 4; ++r) k[r] = keys[std::min<int64_t>(j + r, n - 1)];
    __m256 acc[8];  // query 0's four keys, then query 1's
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int v = 0; v < NV; ++v) {
      __m256 x0 = _mm256_loadu_ps(q0 + 8 * v), x1 = _mm256_loadu_ps(q1 + 8 * v);
      in_register(x0);
      in_register(x1);
      for (int r = 0; r < 4; ++r) {
        __m256 kv = _mm256_loadu_ps(k[r] + 8 * v);
        in_register(kv);
        acc[r] = _mm256_fmadd_ps(x0, kv, acc[r]);
        acc[4 + r] = _mm256_fmadd_ps(x1, kv, acc[4 + r]);
      }
    }
    const __m256 dots = reduce8(acc);
    if (j + 4 <= n) {
      _mm_storeu_ps(s0 + j, _mm256_castps256_ps128(dots));
      _mm_storeu_ps(s1 + j, _mm256_extractf128_ps(dots, 1));
    } else {
      alignas(32) float t[8];
      _mm256_store_ps(t, dots);
      std::copy_n(t, n - j, s0 + j);
      std::copy_n(t + 4, n - j, s1 + j);
    }
  }
}

// The 8 x 8 block r[0..8) transposed in place.
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h)  // rows 4h..4h+3: columns c and c + 4 of each, c = 0..3
    for (int i = 0; i < 2; ++i) {
      u[4 * h + 2 * i] = _mm256_shuffle_ps(t[4 * h + i], t[4 * h + i + 2], 0x44);
      u[4 * h + 2 * i + 1] = _mm256_shuffle_ps(t[4 * h + i], t[4 * h + i + 2], 0xEE);
    }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// kKeyBlock key rows of head_dim floats transposed: kt[d * kKeyBlock + j] = rows[j][d].
void transpose_block(const float* const* rows, int64_t head_dim, float* kt) {
  for (int64_t j0 = 0; j0 < kKeyBlock; j0 += 8)
    for (int64_t d0 = 0; d0 < head_dim; d0 += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(rows[j0 + j] + d0);
      transpose8(r);
      for (int d = 0; d < 8; ++d) _mm256_storeu_ps(kt + (d0 + d) * kKeyBlock + j0, r[d]);
    }
}

// Four queries' scores over a whole block of keys, from its transposed copy kt: the keys in the lanes, as an outer
// product. Lane l of dot()'s sum is the chain q[l] k[l] + q[8 + l] k[8 + l] + ...; here each such chain is an
// accumulator of its own, and the eight are added as dot()'s lanes are reduced, so each score is dot()'s bit for
// bit. Each key vector loaded serves four queries, and no score needs a horizontal reduction.
template <int NV>
void scores_of_block(const float* const* qs, const float* kt, float* const* ss) {
  constexpr int Q = kBlockQueries;
  for (int j0 = 0; j0 < kKeyBlock; j0 += 16) {
    alignas(32) float lanes[8][Q][2][8];
    for (int l = 0; l < 8; ++l) {
      __m256 acc[Q][2];
      for (auto& a : acc) a[0] = a[1] = _mm256_setzero_ps();
      for (int v = 0; v < NV; ++v) {
        const float* row = kt + (8 * v + l) * kKeyBlock + j0;
        __m256 k0 = _mm256_loadu_ps(row), k1 = _mm256_loadu_ps(row + 8);
        in_register(k0);
        in_register(k1);
        for (int i = 0; i < Q; ++i) {
          const __m256 x = _mm256_broadcast_ss(qs[i] + 8 * v + l);
          acc[i][0] = _mm256_fmadd_ps(x, k0, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(x, k1, acc[i][1]);
        }
      }
      for (int i = 0; i < Q; ++i)
        for (int g = 0; g < 2; ++g) _mm256_store_ps(lanes[l][i][g], acc[i][g]);
    }
    for (int i = 0; i < Q; ++i)
      for (int g = 0; g < 2; ++g) {
        auto lane = [&](int l) { return _mm256_load_ps(lanes[l][i][g]); };
        const __m256 even = _mm256_add_ps(_mm256_add_ps(lane(0), lane(4)), _mm256_add_ps(lane(2), lane(6)));
        const __m256 odd = _mm256_add_ps(_mm256_add_ps(lane(1), lane(5)), _mm256_add_ps(lane(3), lane(7)));
        _mm256_storeu_ps(ss[i] + j0 + 8 * g, _mm256_add_ps(even, odd));
      }
  }
}

// Three queries' weighted values over the same n keys, a strip of four vectors from offset: each value vector is
// loaded once for the three. Each output element is weighted_strip's chain, in key order.
inline void weighted_three_strip(const float* const* ws, const float* const* values, int64_t n, int64_t offset,
                                 float* const* outs) {
  // Twelve named accumulators: GCC keeps an array of them in memory as well, storing it at every key.
  __m256 a0 = _mm256_loadu_ps(outs[0] + offset), a1 = _mm256_loadu_ps(outs[0] + offset + 8);
  __m256 a2 = _mm256_loadu_ps(outs[0] + offset + 16), a3 = _mm256_loadu_ps(outs[0] + offset + 24);
  __m256 b0 = _mm256_loadu_ps(outs[1] + offset), b1 = _mm256_loadu_ps(outs[1] + offset + 8);
  __m256 b2 = _mm256_loadu_ps(outs[1] + offset + 16), b3 = _mm256_loadu_ps(outs[1] + offset + 24);
  __m256 c0 = _mm256_loadu_ps(outs[2] + offset), c1 = _mm256_loadu_ps(outs[2] + offset + 8);
  __m256 c2 = _mm256_loadu_ps(outs[2] + offset + 16), c3 = _mm256_loadu_ps(outs[2] + offset + 24);
  const float *w0 = ws[0], *w1 = ws[1], *w2 = ws[2];
  for (int64_t j = 0; j < n; ++j) {
    const __m256 x = _mm256_broadcast_ss(w0 + j), y = _mm256_broadcast_ss(w1 + j), z = _mm256_broadcast_ss(w2 + j);
    const float* row = values[j] + offset;
    auto step = [&](int i, __m256& a, __m256& b, __m256& c) {
      __m256 v = _mm256_loadu_ps(row + 8 * i);
      in_register(v);
      a = _mm256_fmadd_ps(x, v, a);
      b = _mm256_fmadd_ps(y, v, b);
      c = _mm256_fmadd_ps(z, v, c);
    };
    step(0, a0, b0, c0);
    step(1, a1, b1, c1);
    step(2, a2, b2, c2);
    step(3, a3, b3, c3);
  }
  const __m256 acc[3][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}, {c0, c1, c2, c3}};
  for (int q = 0; q < 3; ++q)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(outs[q] + offset + 8 * i, acc[q][i]);
}

// Whole strips of four vectors: head_dim a multiple of 32.
template <int NV>
void weighted_three(const float* const* ws, const float* const* values, int64_t n, float* const* outs) {
  for (int s = 0; s < NV; s += 4) weighted_three_strip(ws, values, n, 8 * s, outs);
}
#endif

// Any head_dim: dot() and axpy() key by key.
void scores_of_any(const float* q, const float* const* keys, int64_t n, int64_t head_dim, float* scores) {
  for (int64_t j = 0; j < n; ++j) scores[j] = dot(q, keys[j], head_dim);
}
void weighted_sum_any(const float* w, const float* const* values, int64_t n, int64_t head_dim, float* out) {
  for (int64_t j = 0; j < n; ++j) axpy(w[j], values[j], out, head_dim);
}

// The head_dim's query-key and weighted-value loops: unrolled where it is 1..16 whole vectors (64 and 128 are).
struct HeadLoops {
  void (*scores)(const float*, const float* const*, int64_t, float*) = nullptr;
  void (*weighted)(const float*, const float* const*, int64_t, float*) = nullptr;
  void (*scores_two)(const float*, const float*, const float* const*, int64_t, float*, float*) = nullptr;
  void (*scores_block)(const float* const*, const float*, float* const*) = nullptr;
  void (*weighted_three)(const float* const*, const float* const*, int64_t, float* const*) = nullptr;
};
template <int... NV>
HeadLoops head_loops_for(int64_t nv, std::integer_sequence<int, NV...>) {
  HeadLoops loops;
#if defined(CPU_CAPABILITY_AVX2)
  ((nv == NV + 1 ? (loops = {scores_of<NV + 1>, weighted_sum<NV + 1>, scores_of_two<NV + 1>, scores_of_block<NV + 1>,
                             (NV + 1) % 4 == 0 ? weighted_three<NV + 1> : nullptr},
                    0)
                 : 0),
   ...);
#else
  ((nv == NV + 1 ? (loops = {scores_of<NV + 1>, weighted_sum<NV + 1>}, 0) : 0), ...);
#endif
  return loops;
}
HeadLoops head_loops(int64_t head_dim) {
  if (head_dim % Vec::size() != 0) return {};
  return head_loops_for(head_dim / Vec::size(), std::make_integer_sequence<int, 16>{});
}

// A row as float32: float rows are used in place, others converted into buf (convert.h).
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  llmmesh_convert::convert_row(src, buf, n);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}

// Asks for a row of n elements to be brought into cache, one 64-byte line at a time.
template <typename T>
inline void prefetch(const T* p, int64_t n) {
  for (int64_t i = 0; i < n * int64_t(sizeof(T)); i += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + i);
}

struct Item {
  int64_t req, kv_head, row, rows, len;  // query tokens row..row+rows-1; len: keys the last one sees
  int64_t key0, key1;                    // the keys it reads: its rows' windows (0..len without), or a part's chunk
  int64_t part;                          // a part's first query among the parts' sums; -1: a whole item
};

// A chunk's values per query: its scores' max, the sum of their exponentials, then the unnormalized output.
inline int64_t partial_size(int64_t head_dim) { return head_dim + 2; }

// exp(s - max) of s[0..n) in place; the max and the sum of the exponentials.
struct SoftmaxSums {
  float max, sum;
};
inline SoftmaxSums softmax_unnormalized(float* s, int64_t n) {
  const float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, n);
  const Vec m(mx);
  auto add = [](Vec& x, Vec& y) { return x + y; };
  if (n < Vec::size()) {
    at::vec::map([m](Vec x) { return (x - m).exp_u20(); }, s, s, n);
    return {mx, at::vec::reduce_all<float>(add, s, n)};
  }
  // The exponentials summed as they are stored, in reduce_all's order: one running vector, a last partial vector's
  // lanes added alone, then the lanes reduced as vec_reduce_all does.
  Vec acc = (Vec::loadu(s) - m).exp_u20();
  acc.store(s);
  int64_t d = Vec::size();
  for (; d + Vec::size() <= n; d += Vec::size()) {
    const Vec e = (Vec::loadu(s + d) - m).exp_u20();
    e.store(s + d);
    acc = acc + e;
  }
  if (d < n) {
    const Vec e = (Vec::loadu(s + d, n - d) - m).exp_u20();
    e.store(s + d, n - d);
    acc = Vec::set(acc, acc + e, n - d);
  }
  return {mx, at::vec::vec_reduce_all<float>(add, acc)};
}

// cap * tanh(s) of s[0..n): Gemma 2's soft-capping, on scores already divided by the cap (the query was scaled by
// scale / cap, which saves a division per score).
inline void soft_cap(float* s, int64_t n, float cap) {
  at::vec::map([cap](Vec x) { return x.tanh() * Vec(cap); }, s, s, n);
}

// The chunks' sums of one query (num_chunks of them, stride floats apart, in key order) rescaled to their common
// max and summed in that order, then normalized into its output row. The one way every query is finished.
template <typename T>
inline void merge_chunks(const float* chunks, int64_t num_chunks, int64_t stride, int64_t head_dim, const float* sink,
                         float* out, T* dst) {
  float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
  for (int64_t c = 0; c < num_chunks; ++c) mx = std::max(mx, chunks[c * stride]);
  std::fill(out, out + head_dim, 0.f);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const float* part = chunks + c * stride;
    if (part[1] == 0.f) continue;  // the query sees none of this chunk's keys
    const float w = std::exp(part[0] - mx);
    sum += part[1] * w;
    axpy(w, part + 2, out, head_dim);
  }
  if (sink) sum += std::exp(*sink - mx);
  at::vec::map([sum](Vec x) { return x / Vec(sum); }, out, out, head_dim);
  for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(out[d]);
}

// T: the query's and output's dtype; C: the cache's. One item: its keys chunk by chunk, each chunk's K and V rows
// converted once into float32, then each query's sums over the keys of the chunk it sees. A whole item merges its
// queries' chunks at once; a part (one chunk) leaves its sums in partials for merge_parts.
template <typename T, typename C>
void attend_item(const Item& it, const T* q_base, int64_t qs0, int64_t qs1, const C* k_base, const C* v_base,
                 int64_t cs0, int64_t cs1, int64_t cs2, int64_t block_size, const int64_t* blocks, int64_t group,
                 int64_t head_dim, double scale, int64_t window, float cap, const float* sinks, T* o_base,
                 int64_t os0, int64_t os1, float* partials) {
  // Buffers (megabytes at long contexts) live as long as the thread: allocated anew each call, they are fresh pages
  // to fault in on every layer.
  thread_local std::vector<float> keys, values, key_block, scores, q, sums_buf, out;
  thread_local std::vector<const float*> key_rows, value_rows;
  thread_local std::vector<std::pair<int64_t, int64_t>> ranges;
  const int64_t nq = it.rows * group, h0 = it.kv_head * group, ps = partial_size(head_dim);
  if (it.len <= 0) {  // a padding request (seq_len 0): sees nothing, outputs zero
    for (int64_t g = 0; g < group; ++g) std::fill_n(o_base + it.row * os0 + (h0 + g) * os1, head_dim, T(0));
    return;
  }
  const int64_t first_chunk = it.key0 / kKeyChunk, num_chunks = (it.key1 - 1) / kKeyChunk + 1 - first_chunk;
  keys.resize(kKeyChunk * head_dim);
  values.resize(kKeyChunk * head_dim);
  key_block.resize(kKeyBlock * head_dim);
  key_rows.resize(kKeyChunk);
  value_rows.resize(kKeyChunk);
  const HeadLoops loops = head_loops(head_dim);
  scores.resize(nq * kScoreStride);
  ranges.resize(nq);
  q.resize(nq * head_dim);
  out.resize(head_dim);
  // A whole item's sums: query i's chunk c at (i * num_chunks + c) * ps; a part's: query i's at (part + i) * ps.
  float* chunk_sums = partials;
  if (it.part < 0) {
    sums_buf.resize(nq * num_chunks * ps);
    chunk_sums = sums_buf.data();
  }
  // Query i = (row j, head g) at row j * group + g. Its rows are asked for first: rows of a wider tensor (the
  // projection's q, k and v), they are scattered lines the hardware prefetcher does not follow.
  for (int64_t j = 0; j < it.rows; ++j) prefetch(q_base + (it.row + j) * qs0 + h0 * qs1, group * qs1);
  for (int64_t j = 0; j < it.rows; ++j)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = q_base + (it.row + j) * qs0 + (h0 + g) * qs1;
      float* dst = q.data() + (j * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * scale;
    }
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t k0 = std::max(it.key0, (first_chunk + c) * kKeyChunk);
    const int64_t k1 = std::min(it.key1, (first_chunk + c + 1) * kKeyChunk);
    // Block by block, the next block asked for ahead (blocks are scattered pages: the hardware prefetcher stops at
    // each one's end).
    for (int64_t pos = k0; pos < k1; ++pos) {
      const int64_t offset = it.kv_head * cs0 + blocks[pos / block_size] * cs1 + (pos % block_size) * cs2;
      if ((pos == k0 || pos % block_size == 0) && (pos / block_size + 1) * block_size < k1) {
        const int64_t next = it.kv_head * cs0 + blocks[pos / block_size + 1] * cs1;
        prefetch(k_base + next, block_size * cs2);
        prefetch(v_base + next, block_size * cs2);
      }
      // Float32 rows are read in place; others are converted once for all the item's queries.
      key_rows[pos - k0] = as_float(k_base + offset, keys.data() + (pos - k0) * head_dim, head_dim);
      value_rows[pos - k0] = as_float(v_base + offset, values.data() + (pos - k0) * head_dim, head_dim);
    }
    // Each query's keys [a, b) of the chunk; its sums at dst. The keys are visited a block at a time for every
    // query (a block's rows stay in L1 while all the queries use them), first for the scores, then for the
    // weighted values: each query still sums its keys in key order.
    for (int64_t i = 0; i < nq; ++i) {
      // Row j, at position p = it.len - it.rows + j, sees keys p - window + 1..p (0..p without a window).
      const int64_t p = it.len - it.rows + i / group;
      ranges[i] = {std::max(k0, window > 0 ? p + 1 - window : 0), std::min(k1, p + 1)};
    }
    // Query i's keys within the block from kb, and where its scores for them go.
    auto in_block = [&](int64_t i, int64_t kb) {
      return std::pair{std::max(ranges[i].first, kb), std::min(ranges[i].second, kb + kKeyBlock)};
    };
    auto scores_from = [&](int64_t i, int64_t lo) { return scores.data() + i * kScoreStride + (lo - ranges[i].first); };
    auto sums_of = [&](int64_t i) { return chunk_sums + (it.part < 0 ? i * num_chunks + c : it.part + i) * ps; };
    // Many queries over a block (a prompt's tile: its rows times the group) take the block ways: those that see all
    // of a block's keys, consecutive, run kBlockQueries at a time from its transposed copy, and three that see the
    // same keys share each value row's loads. A few (a decode's group) read the rows as they lie, which on a decode
    // are still in flight from memory.
    const bool block_ways = nq >= kMinBlockQueries && loops.scores_block;
    for (int64_t kb = k0; kb < k1; kb += kKeyBlock) {
      int64_t w0 = nq, w1 = nq;  // queries [w0, w1) run from the transposed block; none: both nq
      if (block_ways && kb + kKeyBlock <= k1) {
        const std::pair whole{kb, kb + kKeyBlock};
        int64_t a = 0, b;
        while (a < nq && in_block(a, kb) != whole) ++a;
        for (b = a; b < nq && in_block(b, kb) == whole; ++b) {
        }
        if (b - a >= kBlockQueries) w0 = a, w1 = a + (b - a) / kBlockQueries * kBlockQueries;
      }
#if defined(CPU_CAPABILITY_AVX2)  // the block ways' kernels; elsewhere block_ways is false
      if (w1 > w0) {
        transpose_block(key_rows.data() + (kb - k0), head_dim, key_block.data());
        for (int64_t i = w0; i < w1; i += kBlockQueries) {
          const float* qs[kBlockQueries];
          float* ss[kBlockQueries];
          for (int r = 0; r < kBlockQueries; ++r) {
            qs[r] = q.data() + (i + r) * head_dim;
            ss[r] = scores_from(i + r, kb);
          }
          loops.scores_block(qs, key_block.data(), ss);
        }
      }
#endif
      for (int64_t i = 0; i < nq; ++i) {
        if (i == w0) i = w1;
        if (i >= nq) break;
        const auto [lo, hi] = in_block(i, kb);
        if (lo >= hi) continue;
        const float* qi = q.data() + i * head_dim;
        const float* const* rows = key_rows.data() + (lo - k0);
        if (loops.scores_two && i + 1 < nq && i + 1 != w0 && in_block(i + 1, kb) == std::pair{lo, hi}) {
          // The next query sees the same keys of this block: the two share them.
          loops.scores_two(qi, qi + head_dim, rows, hi - lo, scores_from(i, lo), scores_from(i + 1, lo));
          ++i;
        } else if (loops.scores) {
          loops.scores(qi, rows, hi - lo, scores_from(i, lo));
        } else {
          scores_of_any(qi, rows, hi - lo, head_dim, scores_from(i, lo));
        }
      }
    }
    for (int64_t i = 0; i < nq; ++i) {
      const auto [a, b] = ranges[i];
      float* dst = sums_of(i);
      std::fill(dst + 2, dst + ps, 0.f);
      if (a >= b) {
        dst[0] = -std::numeric_limits<float>::infinity();
        dst[1] = 0.f;
        continue;
      }
      float* s = scores.data() + i * kScoreStride;
      if (cap > 0) soft_cap(s, b - a, cap);
      const SoftmaxSums sums = softmax_unnormalized(s, b - a);
      dst[0] = sums.max;
      dst[1] = sums.sum;
    }
    for (int64_t kb = k0; kb < k1; kb += kKeyBlock)
      for (int64_t i = 0; i < nq; ++i) {
        const auto [lo, hi] = in_block(i, kb);
        if (lo >= hi) continue;
        const float* const* rows = value_rows.data() + (lo - k0);
        if (block_ways && loops.weighted_three && i + 2 < nq && in_block(i + 1, kb) == std::pair{lo, hi} &&
            in_block(i + 2, kb) == std::pair{lo, hi}) {
          const float* ws[3] = {scores_from(i, lo), scores_from(i + 1, lo), scores_from(i + 2, lo)};
          float* outs[3] = {sums_of(i) + 2, sums_of(i + 1) + 2, sums_of(i + 2) + 2};
          loops.weighted_three(ws, rows, hi - lo, outs);
          i += 2;
        } else if (loops.weighted) {
          loops.weighted(scores_from(i, lo), rows, hi - lo, sums_of(i) + 2);
        } else {
          weighted_sum_any(scores_from(i, lo), rows, hi - lo, head_dim, sums_of(i) + 2);
        }
      }
  }
  if (it.part >= 0) return;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t head = h0 + i % group;
    merge_chunks(chunk_sums + i * num_chunks * ps, num_chunks, ps, head_dim, sinks ? sinks + head : nullptr,
                 out.data(), o_base + (it.row + i / group) * os0 + head * os1);
  }
}

// Each split item's parts (split[s]: its first part and how many, one a chunk, each holding its queries' sums one
// after another) merged into its output rows.
template <typename T>
void merge_parts(const std::vector<Item>& items, const std::vector<std::pair<int64_t, int64_t>>& split, int64_t group,
                 int64_t head_dim, const float* partials, const float* sinks, T* o_base, int64_t os0, int64_t os1) {
  at::parallel_for(0, split.size(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out(head_dim);
    for (int64_t s = begin; s < end; ++s) {
      const auto [first, num_parts] = split[s];
      const Item& it = items[first];
      const int64_t nq = it.rows * group, ps = partial_size(head_dim);
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t head = it.kv_head * group + i % group;
        merge_chunks(partials + (it.part + i) * ps, num_parts, nq * ps, head_dim, sinks ? sinks + head : nullptr,
                     out.data(), o_base + (it.row + i / group) * os0 + head * os1);
      }
    }
  });
}

// T: the query's and output's dtype; C: the cache's.
template <typename T, typename C>
void attend(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* table,
            int64_t table_stride, const std::vector<Item>& items, int64_t begin, int64_t end, double scale,
            int64_t window, float cap, const float* sinks, at::Tensor& out, float* partials) {
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(2), group = num_heads / k_cache.size(0);
  const C* k_base = static_cast<const C*>(k_cache.data_ptr());
  const C* v_base = static_cast<const C*>(v_cache.data_ptr());
  for (int64_t i = begin; i < end; ++i)
    attend_item<T, C>(items[i], query.data_ptr<T>(), query.stride(0), query.stride(1), k_base, v_base,
                      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_size,
                      table + items[i].req * table_stride, group, head_dim, scale, window, cap, sinks,
                      out.data_ptr<T>(), out.stride(0), out.stride(1), partials);
}

void check_batch(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "K and V caches must share strides");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(0) == 0, "heads do not match");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.stride(3) == 1, "the head dimension must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the K and V caches must share a dtype");
  for (const auto* t : {&query_start_loc, &seq_lens, &block_table})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors must be contiguous int64");
  TORCH_CHECK(query_start_loc.numel() == seq_lens.numel() + 1 && block_table.size(0) >= seq_lens.numel(),
              "query_start_loc, seq_lens and block_table disagree on the number of requests");
}

// Calls f with a value of the C++ type of a cache dtype.
template <typename F>
void dispatch_cache_type(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    case at::kFloat8_e4m3fn:
      return f(c10::Float8_e4m3fn{});
    case at::kFloat8_e5m2:
      return f(c10::Float8_e5m2{});
    default:
      TORCH_CHECK(false, "no KV cache of dtype ", type, ": float32, bfloat16, float16, fp8_e4m3 or fp8_e5m2");
  }
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           const at::Tensor& block_table, double scale, std::optional<int64_t> sliding_window,
                           std::optional<double> logits_soft_cap, const std::optional<at::Tensor>& sinks) {
  check_batch(query, k_cache, v_cache, query_start_loc, seq_lens, block_table);
  if (sinks)
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == query.size(1),
                "sinks must be contiguous float32, one a query head");
  const float* sink_ptr = sinks ? sinks->data_ptr<float>() : nullptr;
  TORCH_CHECK(sliding_window.value_or(1) > 0 && logits_soft_cap.value_or(1) > 0,
              "sliding_window and logits_soft_cap must be positive (or None)");
  const int64_t window = sliding_window.value_or(0);
  const float cap = logits_soft_cap.value_or(0);
  if (cap > 0) scale /= cap;  // see soft_cap
  const int64_t num_reqs = seq_lens.numel(), num_kv_heads = k_cache.size(0);
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();

  at::Tensor out = at::empty_like(query, at::MemoryFormat::Contiguous);
  // Rows past the last request belong to none: zero, as in the reference.
  if (starts[num_reqs] < query.size(0)) out.narrow(0, starts[num_reqs], query.size(0) - starts[num_reqs]).zero_();

  std::vector<Item> items;
  std::vector<int64_t> cost{0};  // prefix sums of item cost
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t n = starts[r + 1] - starts[r];
    // Tiles of at most kMaxTileRows rows, whatever the number of threads (so are the results). A request whose
    // first row sees no key (padding, seq_len 0) gets one-row items, each zeroed alone.
    const int64_t tiles = lens[r] - n < 0 ? n : (n + kMaxTileRows - 1) / kMaxTileRows;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t j0 = n * t / tiles, j1 = n * (t + 1) / tiles, len = lens[r] - n + j1;
        // The first row's window starts the keys any row of the tile sees.
        const int64_t key0 = window > 0 ? std::max<int64_t>(0, lens[r] - n + j0 + 1 - window) : 0;
        items.push_back({r, h, starts[r] + j0, j1 - j0, len, key0, std::max<int64_t>(len, 0), -1});
      }
  }
  // Too few items to share among threads: each item of several chunks runs each chunk as a part.
  std::vector<std::pair<int64_t, int64_t>> split;  // (first part, parts) of each split item, in items
  int64_t num_partial_queries = 0;
  if (!items.empty() && int64_t(items.size()) < kMinItems) {
    std::vector<Item> parts;
    for (const Item& it : items) {
      const int64_t first = it.key0 / kKeyChunk, n = it.key1 <= 0 ? 0 : (it.key1 - 1) / kKeyChunk + 1 - first;
      if (n < 2) {
        parts.push_back(it);
        continue;
      }
      split.push_back({int64_t(parts.size()), n});
      for (int64_t p = 0; p < n; ++p) {
        Item part = it;
        part.key0 = std::max(it.key0, (first + p) * kKeyChunk);
        part.key1 = std::min(it.key1, (first + p + 1) * kKeyChunk);
        part.part = num_partial_queries;
        num_partial_queries += it.rows * (query.size(1) / num_kv_heads);
        parts.push_back(part);
      }
    }
    items = std::move(parts);
  }
  for (const Item& it : items) cost.push_back(cost.back() + it.rows * (it.key1 - it.key0) + kItemOverhead);
  std::vector<float> partials(num_partial_queries * partial_size(query.size(2)));
  // One contiguous range of items per thread, of about equal cost.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  auto boundary = [&](int64_t p) {
    return int64_t(std::lower_bound(cost.begin(), cost.end(), cost.back() * p / parts) - cost.begin());
  };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    dispatch_cache_type(k_cache.scalar_type(), [&](auto cache_value) {
      using cache_t = decltype(cache_value);
      at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p)
          attend<scalar_t, cache_t>(query, k_cache, v_cache, block_table.data_ptr<int64_t>(), block_table.stride(0),
                                    items, boundary(p), boundary(p + 1), scale, window, cap, sink_ptr, out,
                                    partials.data());
      });
    });
    if (!split.empty())
      merge_parts<scalar_t>(items, split, query.size(1) / num_kv_heads, query.size(2), partials.data(), sink_ptr,
                            out.data_ptr<scalar_t>(), out.stride(0), out.stride(1));
  });
  return out;
}

// Write token i's K/V [num_kv_heads, head_dim] to slot slot_mapping[i] of the caches; slot -1 is padding.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(),
              "K/V and caches must share a dtype (a caller converts them first)");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slots must be int64");
  const int64_t num_tokens = slot_mapping.numel(), num_kv_heads = k_cache.size(0), block_size = k_cache.size(2);
  const int64_t bytes = k_cache.size(3) * k_cache.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  const int64_t es = k_cache.element_size();
  for (int64_t i = 0; i < num_tokens; ++i) {
    if (slots[i] < 0) continue;
    const int64_t b = slots[i] / block_size, o = slots[i] % block_size;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      std::memcpy(kc + (h * k_cache.stride(0) + b * k_cache.stride(1) + o * k_cache.stride(2)) * es,
                  k + (i * key.stride(0) + h * key.stride(1)) * es, bytes);
      std::memcpy(vc + (h * v_cache.stride(0) + b * v_cache.stride(1) + o * v_cache.stride(2)) * es,
                  v + (i * value.stride(0) + h * value.stride(1)) * es, bytes);
    }
  }
}
