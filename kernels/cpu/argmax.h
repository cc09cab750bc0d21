// The argmax of each row of logits, read in their own dtype (no float32 copy): the sampler's greedy rows
// (sampling.cpp) and the sampler service's greedy steps (greedy_steps.cpp). Each row goes in blocks: the block
// holding the row's largest value is found with vectorized maxima alone, and only that block is scanned again for
// the value's first index. The answer is torch.argmax's: the first index of the largest value, or of the first NaN
// in a row that holds one.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace llmmesh_argmax {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t BLOCK = 1024;  // elements: a block is in L1 when it is scanned again

inline float nan_max(float a, float b) { return (std::isnan(b) || b > a) ? b : a; }

// The largest of x[0, n) as float32; NaN if any is NaN.
template <typename scalar_t>
inline float block_max(const scalar_t* x, int64_t n) {
  constexpr int64_t V = Vec::size();
  Vec m0(-std::numeric_limits<float>::infinity()), m1 = m0;
  int64_t i = 0;
  for (; i + 2 * V <= n; i += 2 * V) {
    Vec lo, hi;
    if constexpr (std::is_same_v<scalar_t, float>) {
      lo = Vec::loadu(x + i);
      hi = Vec::loadu(x + i + V);
    } else {
      at::vec::load_to_float<scalar_t>(x + i, lo, hi);
    }
    m0 = at::vec::maximum(m0, lo);  // at::vec::maximum keeps a NaN
    m1 = at::vec::maximum(m1, hi);
  }
  float lanes[V];
  at::vec::maximum(m0, m1).store(lanes);
  float m = lanes[0];
  for (int64_t j = 1; j < V; ++j) m = nan_max(m, lanes[j]);
  for (; i < n; ++i) m = nan_max(m, static_cast<float>(x[i]));
  return m;
}

template <typename scalar_t>
inline int64_t row_argmax(const scalar_t* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_start = 0;
  for (int64_t start = 0; start < n; start += BLOCK) {
    const float m = block_max(x + start, std::min(BLOCK, n - start));
    if (std::isnan(m) || m > best) {  // strictly greater: the first block that holds the maximum
      best = m;
      best_start = start;
      if (std::isnan(m)) break;
    }
  }
  const int64_t end = std::min(n, best_start + BLOCK);
  for (int64_t i = best_start; i < end; ++i) {
    const float v = static_cast<float>(x[i]);
    if (v == best || (std::isnan(best) && std::isnan(v))) return i;
  }
  return best_start;  // not reached: the block holds its maximum
}

template <typename scalar_t>
inline void argmax_rows_of(const scalar_t* x, int64_t rows, int64_t vocab, int64_t stride, int64_t* ids, bool parallel) {
  at::parallel_for(0, rows, parallel ? 16 : rows + 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ids[r] = row_argmax(x + r * stride, vocab);
  });
}

}  // namespace llmmesh_argmax
