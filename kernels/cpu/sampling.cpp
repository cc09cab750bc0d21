// Greedy sampling on the CPU: the argmax of each row of a step's logits, read in their own dtype (no float32
// copy). torch's argmax carries an index beside every value and runs about ten times slower than this on a
// [64, 49152] bfloat16 block; here each row goes in blocks, the block holding the row's largest value is found
// with vectorized maxima alone, and only that block is scanned again for the value's first index. The answer is
// torch.argmax's: the first index of the largest value, or of the first NaN in a row that holds one. parallel=False
// keeps it on the calling thread (a sampler service whose host's other core is the engine's during the step).
// Registered as torch.ops.llmmesh_sampling.argmax_rows when the library loads (engine/sample/ops.py calls it).

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t BLOCK = 1024;  // elements: a block is in L1 when it is scanned again

inline float nan_max(float a, float b) { return (std::isnan(b) || b > a) ? b : a; }

// The largest of x[0, n) as float32; NaN if any is NaN.
template <typename scalar_t>
float block_max(const scalar_t* x, int64_t n) {
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
int64_t row_argmax(const scalar_t* x, int64_t n) {
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
void argmax_rows_of(const scalar_t* x, int64_t rows, int64_t vocab, int64_t stride, int64_t* ids, bool parallel) {
  at::parallel_for(0, rows, parallel ? 16 : rows + 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ids[r] = row_argmax(x + r * stride, vocab);
  });
}

at::Tensor argmax_rows(const at::Tensor& logits, bool parallel) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [rows, vocab] with vocab > 0");
  TORCH_CHECK(logits.stride(1) == 1, "each row of logits must be contiguous");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  switch (logits.scalar_type()) {
    case at::kFloat:
      argmax_rows_of(logits.const_data_ptr<float>(), rows, vocab, stride, ids, parallel);
      break;
    case at::kBFloat16:
      argmax_rows_of(logits.const_data_ptr<at::BFloat16>(), rows, vocab, stride, ids, parallel);
      break;
    case at::kHalf:
      argmax_rows_of(logits.const_data_ptr<at::Half>(), rows, vocab, stride, ids, parallel);
      break;
    default:
      TORCH_CHECK(false, "logits must be float32, bfloat16 or float16, got ", logits.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(llmmesh_sampling, m) { m.def("argmax_rows(Tensor logits, bool parallel=True) -> Tensor"); }
TORCH_LIBRARY_IMPL(llmmesh_sampling, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
