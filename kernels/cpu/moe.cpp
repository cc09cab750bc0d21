// The mixture-of-experts layer's experts on the CPU, one call a layer (the torch reference is
// engine/models/fused_moe.py's fused_experts). The step's (token, expert) pairs are grouped by expert (a counting
// sort, each expert's pairs in token order); each expert's group is cut into blocks of up to BLOCK tokens, split
// between threads, and a block reads each row of its expert's w13 [2I, H] and w2 [H, I] once, widened to float32,
// with the block's accumulators in registers:
//   g, u = w13[e] x          (gate rows, then up rows)
//   h    = silu(g) * u
//   y    = w2[e] h, times the pair's router weight
// Each pair's y lands in its own row, and a second pass adds each token's rows in expert order: no two threads
// write one row. In bfloat16 the products and the sum are rounded to bfloat16 where torch's layer rounds them.
//
// fused_moe takes float32 or bfloat16 weights; fused_moe_quant group-wise codes (kernels/quant.py's format, a
// leading expert dimension: GGUF's blocks, int8, int4), each row dequantized to float32 as the block reaches it,
// so that only the experts the step's tokens chose are read, and never held dequantized.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t BLOCK = 8;
constexpr int64_t V = Vec::size();

// out[b * out_stride + j] = w[j] . xf[b] for the block's nb tokens (their rows in float32, `in` apart), j < rows.
template <typename w_t>
void rows_times_block(const w_t* w, int64_t rows, int64_t in, const float* xf, int64_t nb, float* out,
                      int64_t out_stride) {
  for (int64_t j = 0; j < rows; ++j) {
    const w_t* wr = w + j * in;
    std::array<Vec, BLOCK> acc;
    acc.fill(Vec(0.f));
    int64_t i = 0;
    for (; i + V <= in; i += V) {
      Vec wv;
      if constexpr (std::is_same_v<w_t, float>) {
        wv = Vec::loadu(wr + i);
      } else {
        at::vec::load_to_float<w_t>(wr + i, wv);
      }
      for (int64_t b = 0; b < nb; ++b) acc[b] = at::vec::fmadd(wv, Vec::loadu(xf + b * in + i), acc[b]);
    }
    for (int64_t b = 0; b < nb; ++b) {
      float sum = at::vec::vec_reduce_all<float>([](Vec a, Vec c) { return a + c; }, acc[b]);
      for (int64_t t = i; t < in; ++t) sum += static_cast<float>(wr[t]) * xf[b * in + t];
      out[b * out_stride + j] = sum;
    }
  }
}

// A projection of every expert in the weights' own dtype: [E, rows, in].
template <typename w_t>
struct DenseWeights {
  const w_t* w;
  int64_t rows, in;
  void times_block(int64_t e, const float* xf, int64_t nb, float* out, int64_t out_stride, float*) const {
    rows_times_block(w + e * rows * in, rows, in, xf, nb, out, out_stride);
  }
};

// A projection of every expert as int8 codes [E, rows, in] with float32 scales and zeros [E, rows, in / group]:
// each row dequantized (q * scale + zero) into `row`, then multiplied as a float32 one.
struct GroupQuantWeights {
  const int8_t* q;
  const float *scales, *zeros;
  int64_t rows, in, group;
  void times_block(int64_t e, const float* xf, int64_t nb, float* out, int64_t out_stride, float* row) const {
    const int64_t groups = in / group;
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t r = e * rows + j;
      const int8_t* qr = q + r * in;
      for (int64_t g = 0; g < groups; ++g) {
        const float scale = scales[r * groups + g], zero = zeros[r * groups + g];
        for (int64_t c = g * group; c < (g + 1) * group; ++c) row[c] = static_cast<float>(qr[c]) * scale + zero;
      }
      rows_times_block(row, 1, in, xf, nb, out + j, out_stride);
    }
  }
};

// A value rounded to scalar_t and back: where torch's layer holds a product in the model's dtype.
template <typename scalar_t>
inline float round_to(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
}

// The experts for x [tokens, H] (float32 or bfloat16), topk_weights [tokens, k] float32 and topk_ids [tokens, k]
// int64, with w13 [E, 2I, H] and w2 [E, H, I] (DenseWeights or GroupQuantWeights) -> [tokens, H] in x's dtype.
template <typename W13, typename W2>
at::Tensor run_experts(const at::Tensor& x, const W13& w13, const W2& w2, int64_t experts, int64_t inter,
                       const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_weights.scalar_type() == at::kFloat &&
                  topk_ids.is_contiguous() && topk_weights.is_contiguous() && topk_ids.dim() == 2 &&
                  topk_ids.sizes() == topk_weights.sizes() && topk_ids.size(0) == tokens,
              "topk_ids (int64) and topk_weights (float32) must be contiguous [tokens, k]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "fused_moe computes in float32 or bfloat16, not ", x.scalar_type());
  const int64_t top_k = topk_ids.size(1), pairs = tokens * top_k;
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* weights = topk_weights.data_ptr<float>();
  // Counting sort of the pairs by expert; within an expert, in token order.
  std::vector<int64_t> start(experts + 1, 0), sorted(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < experts, "expert id out of range");
    ++start[ids[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) sorted[fill[ids[p]]++] = p;
  // Each pair's row of y, by its place in the sorted order: (expert, first place, count) a block.
  std::vector<std::array<int64_t, 3>> blocks;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t b = start[e]; b < start[e + 1]; b += BLOCK)
      blocks.push_back({e, b, std::min(BLOCK, start[e + 1] - b)});
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  at::Tensor y = at::empty({pairs, hidden}, x.options().dtype(at::kFloat));
  auto run = [&](auto type) {
    using scalar_t = decltype(type);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xf(BLOCK * hidden), gu(BLOCK * 2 * inter), h(BLOCK * inter), yb(BLOCK * hidden);
      std::vector<float> row(std::max(hidden, inter));  // a quantized weight's row, dequantized
      for (int64_t i = begin; i < end; ++i) {
        const auto [e, first, count] = blocks[i];
        for (int64_t b = 0; b < count; ++b) {
          const scalar_t* src = xp + (sorted[first + b] / top_k) * hidden;
          for (int64_t c = 0; c < hidden; ++c) xf[b * hidden + c] = static_cast<float>(src[c]);
        }
        w13.times_block(e, xf.data(), count, gu.data(), 2 * inter, row.data());
        for (int64_t b = 0; b < count; ++b)
          for (int64_t c = 0; c < inter; ++c) {
            const float g = round_to<scalar_t>(gu[b * 2 * inter + c]);
            const float u = round_to<scalar_t>(gu[b * 2 * inter + inter + c]);
            h[b * inter + c] = round_to<scalar_t>(round_to<scalar_t>(g / (1.f + std::exp(-g))) * u);
          }
        w2.times_block(e, h.data(), count, yb.data(), hidden, row.data());
        for (int64_t b = 0; b < count; ++b) {
          const float weight = weights[sorted[first + b]];
          float* dst = yp + (first + b) * hidden;
          for (int64_t c = 0; c < hidden; ++c)
            dst[c] = round_to<scalar_t>(round_to<scalar_t>(yb[b * hidden + c]) * weight);
        }
      }
    });
    // Each token's pairs, in expert order: where they sit in the sorted order.
    std::vector<int64_t> place(pairs);
    for (int64_t s = 0; s < pairs; ++s) place[sorted[s]] = s;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
      std::vector<int64_t> order(top_k);
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t k = 0; k < top_k; ++k) order[k] = place[t * top_k + k];
        std::sort(order.begin(), order.end());
        scalar_t* dst = op + t * hidden;
        for (int64_t c = 0; c < hidden; ++c) {
          float sum = 0.f;
          for (int64_t s : order) sum = round_to<scalar_t>(sum + yp[s * hidden + c]);
          dst[c] = static_cast<scalar_t>(sum);
        }
      }
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(c10::BFloat16{});
  }
  return out;
}

}  // namespace

// x [tokens, H], w13 [E, 2I, H] and w2 [E, H, I] of one dtype (float32 or bfloat16), topk_weights [tokens, k]
// float32, topk_ids [tokens, k] int64 -> [tokens, H] in x's dtype.
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& topk_weights,
                     const at::Tensor& topk_ids) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && x.is_contiguous() && w13.is_contiguous() &&
                  w2.is_contiguous(),
              "fused_moe takes contiguous x [tokens, H], w13 [E, 2I, H] and w2 [E, H, I]");
  TORCH_CHECK(x.scalar_type() == w13.scalar_type() && x.scalar_type() == w2.scalar_type(),
              "x, w13 and w2 must share a dtype");
  const int64_t hidden = x.size(1), experts = w13.size(0), inter = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == hidden && w2.size(0) == experts && w2.size(1) == hidden,
              "fused_moe: x, w13 and w2 disagree in shape");
  if (x.scalar_type() == at::kBFloat16) {
    using bf16 = c10::BFloat16;
    return run_experts(x, DenseWeights<bf16>{w13.data_ptr<bf16>(), 2 * inter, hidden},
                       DenseWeights<bf16>{w2.data_ptr<bf16>(), hidden, inter}, experts, inter, topk_weights, topk_ids);
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat, "fused_moe computes in float32 or bfloat16, not ", x.scalar_type());
  return run_experts(x, DenseWeights<float>{w13.data_ptr<float>(), 2 * inter, hidden},
                     DenseWeights<float>{w2.data_ptr<float>(), hidden, inter}, experts, inter, topk_weights, topk_ids);
}

namespace {

// A projection's codes [E, rows, in] (int8) and float32 scales and zeros [E, rows, groups], contiguous.
GroupQuantWeights group_quant_weights(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros,
                                      const char* name) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kChar && q.is_contiguous(), name,
              ": codes must be contiguous int8 [E, rows, in]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && zeros.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  zeros.is_contiguous() && scales.sizes() == zeros.sizes() && scales.dim() == 3 &&
                  scales.size(0) == q.size(0) && scales.size(1) == q.size(1) && scales.size(2) > 0 &&
                  q.size(2) % scales.size(2) == 0,
              name, ": scales and zeros must be contiguous float32 [E, rows, groups], the groups dividing in");
  return {q.data_ptr<int8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), q.size(1), q.size(2),
          q.size(2) / scales.size(2)};
}

}  // namespace

// fused_moe over group-wise codes: w13 codes [E, 2I, H] and w2 codes [E, H, I] (int8), each with float32 scales and
// zeros [E, rows, groups]; x float32 or bfloat16.
at::Tensor fused_moe_quant(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w13_scales,
                           const at::Tensor& w13_zeros, const at::Tensor& w2, const at::Tensor& w2_scales,
                           const at::Tensor& w2_zeros, const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "fused_moe_quant takes a contiguous x [tokens, H]");
  const GroupQuantWeights a = group_quant_weights(w13, w13_scales, w13_zeros, "w13");
  const GroupQuantWeights b = group_quant_weights(w2, w2_scales, w2_zeros, "w2");
  const int64_t experts = w13.size(0), inter = w2.size(2);
  TORCH_CHECK(a.rows == 2 * inter && a.in == x.size(1) && w2.size(0) == experts && b.rows == x.size(1),
              "fused_moe_quant: x, w13 and w2 disagree in shape");
  return run_experts(x, a, b, experts, inter, topk_weights, topk_ids);
}
