// Multi-head latent attention's decode on CPU, in the absorbed form, reading the latent cache in place.
//
// Each decode row r has one query per head already in latent space, query[r, h] = [q_nope W_UK[h], q_pe]
// (kv_lora_rank + qk_rope_head_dim wide, engine/attention/mla.py), and attends to its seq_lens[r] cached latent
// vectors [c, k_pe]: the score is query . [c, k_pe], the value is c, the first v_dim (kv_lora_rank) elements of the
// same row. Every head shares the one cached row (multi-query attention), so a row is read and converted to float32
// once for all heads. The caller applies W_UV to the [rows, heads, v_dim] result.
//
// A row's keys are split into parts at fixed positions, every kPartKeys keys, whatever the batch: threads share the
// parts, each keeps its max, sum and unnormalized output, and a row's parts are merged in order. Within a part, keys
// are taken a chunk at a time, gathered from their pages into float32 rows; both products are matrix multiplies over
// all heads (torch's, single-threaded inside our threads), the softmax online across chunks. So a row's output is
// the same bit for bit alone or in a batch (batch invariance); the engine runs prompt tokens here too.

#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include "convert.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunkKeys = 128;  // keys gathered at a time
constexpr int64_t kPartKeys = 256;   // a row's keys are split at multiples of this

struct Part {
  int64_t row, key0, key1;
};

at::Tensor matrix(float* data, int64_t rows, int64_t cols, int64_t stride) {
  return at::from_blob(data, {rows, cols}, {stride, 1}, at::TensorOptions().dtype(at::kFloat));
}

// One part's keys of one row: acc [heads, v_dim] the unnormalized output, m and l each head's max and sum.
template <typename T, typename C>
void attend_part(const Part& part, const T* q_row, int64_t qs1, const C* cache, int64_t cs0, int64_t cs1,
                 int64_t block_size, const int64_t* blocks, int64_t num_heads, int64_t head_size, int64_t v_dim,
                 float scale, float* acc, float* m, float* l) {
  thread_local std::vector<float> q, rows, scores;
  q.resize(num_heads * head_size);
  rows.resize(kChunkKeys * head_size);
  scores.resize(num_heads * kChunkKeys);
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t d = 0; d < head_size; ++d) q[h * head_size + d] = static_cast<float>(q_row[h * qs1 + d]) * scale;
  std::fill_n(acc, num_heads * v_dim, 0.f);
  std::fill_n(m, num_heads, -std::numeric_limits<float>::infinity());
  std::fill_n(l, num_heads, 0.f);
  at::Tensor q_mat = matrix(q.data(), num_heads, head_size, head_size);
  at::Tensor acc_mat = matrix(acc, num_heads, v_dim, v_dim);
  for (int64_t c0 = part.key0; c0 < part.key1; c0 += kChunkKeys) {
    const int64_t n = std::min(kChunkKeys, part.key1 - c0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = c0 + j;
      llmmesh_convert::convert_row(cache + blocks[pos / block_size] * cs0 + (pos % block_size) * cs1,
                                   rows.data() + j * head_size, head_size);
    }
    at::Tensor s_mat = matrix(scores.data(), num_heads, n, n);
    at::mm_out(s_mat, q_mat, matrix(rows.data(), n, head_size, head_size).t());
    for (int64_t h = 0; h < num_heads; ++h) {
      float* s = scores.data() + h * n;
      const float chunk_max = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, n);
      const float new_max = std::max(m[h], chunk_max);
      at::vec::map([new_max](Vec x) { return (x - Vec(new_max)).exp_u20(); }, s, s, n);
      const float rescale = std::exp(m[h] - new_max);  // 0 at the first chunk: acc and l are 0 then
      l[h] = l[h] * rescale + at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, n);
      at::vec::map([rescale](Vec x) { return x * Vec(rescale); }, acc + h * v_dim, acc + h * v_dim, v_dim);
      m[h] = new_max;
    }
    acc_mat.addmm_(s_mat, matrix(rows.data(), n, v_dim, head_size));  // the values: each row's first v_dim
  }
}

}  // namespace

// query [rows, heads, head_size]; kv_cache [num_blocks, block_size, head_size]; seq_lens [rows] and block_table
// [rows, max_blocks] int64. Returns [rows, heads, v_dim] in the query's dtype; a row of seq_len 0 is zero.
at::Tensor mla_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& seq_lens,
                      const at::Tensor& block_table, int64_t v_dim, double scale) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 3 && query.size(2) == kv_cache.size(2), "bad shapes");
  TORCH_CHECK(0 < v_dim && v_dim <= kv_cache.size(2), "v_dim must be within the latent vector");
  TORCH_CHECK(query.stride(2) == 1 && kv_cache.stride(2) == 1, "the latent dimension must be contiguous");
  for (const auto* t : {&seq_lens, &block_table})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "index tensors must be contiguous int64");
  TORCH_CHECK(seq_lens.numel() == query.size(0) && block_table.size(0) >= query.size(0),
              "query, seq_lens and block_table disagree on the number of rows");
  const int64_t num_rows = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  std::vector<Part> parts;
  std::vector<int64_t> first_part{0};  // row r's parts: first_part[r]..first_part[r + 1]
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t keys = std::max<int64_t>(lens[r], 0);
    parts.push_back({r, 0, std::min(keys, kPartKeys)});  // one part, empty for a row of no keys
    for (int64_t k = kPartKeys; k < keys; k += kPartKeys) parts.push_back({r, k, std::min(keys, k + kPartKeys)});
    first_part.push_back(parts.size());
  }
  // Each part: its heads' max, sum, then unnormalized output.
  const int64_t part_floats = num_heads * (2 + v_dim);
  std::vector<float> partials(parts.size() * part_floats);
  at::Tensor out = at::empty({num_rows, num_heads, v_dim}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "mla_decode", [&] {
    using query_t = scalar_t;
    AT_DISPATCH_V2(
        kv_cache.scalar_type(), "mla_decode_cache", AT_WRAP([&] {
          const auto* cache = kv_cache.data_ptr<scalar_t>();
          at::parallel_for(0, parts.size(), 1, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
              const Part& part = parts[i];
              const query_t* q_row = query.data_ptr<query_t>() + part.row * query.stride(0);
              const int64_t* blocks = block_table.data_ptr<int64_t>() + part.row * block_table.stride(0);
              float* sums = partials.data() + i * part_floats;  // max, sum, output
              attend_part<query_t, scalar_t>(part, q_row, query.stride(1), cache, kv_cache.stride(0),
                                             kv_cache.stride(1), kv_cache.size(1), blocks, num_heads, head_size,
                                             v_dim, float(scale), sums + 2 * num_heads, sums, sums + num_heads);
            }
          });
        }),
        AT_EXPAND(AT_FLOATING_TYPES), at::kBFloat16, at::kHalf, at::kFloat8_e4m3fn, at::kFloat8_e5m2);
    // Each row's parts rescaled to their common max.
    at::parallel_for(0, num_rows * num_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> sum_out(v_dim);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / num_heads, h = i % num_heads;
        float mx = -std::numeric_limits<float>::infinity(), total = 0.f;
        for (int64_t p = first_part[r]; p < first_part[r + 1]; ++p) mx = std::max(mx, partials[p * part_floats + h]);
        std::fill(sum_out.begin(), sum_out.end(), 0.f);
        for (int64_t p = first_part[r]; p < first_part[r + 1]; ++p) {
          const float* part = partials.data() + p * part_floats;
          if (part[num_heads + h] == 0.f) continue;  // no keys in this part
          const float w = std::exp(part[h] - mx);
          total += part[num_heads + h] * w;
          const float* acc = part + 2 * num_heads + h * v_dim;
          for (int64_t d = 0; d < v_dim; ++d) sum_out[d] += w * acc[d];
        }
        query_t* dst = out.data_ptr<query_t>() + r * out.stride(0) + h * out.stride(1);
        for (int64_t d = 0; d < v_dim; ++d) dst[d] = static_cast<query_t>(total > 0.f ? sum_out[d] / total : 0.f);
      }
    });
  });
  return out;
}
