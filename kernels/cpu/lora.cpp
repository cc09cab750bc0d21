// Multi-LoRA on the CPU: one layer's whole adapter delta for a mixed batch in one call (the torch reference is
// kernels/lora.py's lora_shrink_ref/lora_expand_ref). Token t uses slot token_slots[t] (-1: the base model, no
// delta); a slot holds one adapter's A [L * R, in] and B [out, L * R] (B scaled), where L packed slices (q/k/v,
// gate/up) stack their A rows and hold B block-diagonally, by the slot's own rank r: slice i's A rows and B
// columns are [i * r, (i + 1) * r), its outputs the i-th of slice_sizes. Per token, in float32:
//   h = A[slot] x                  (shrink, only the adapter's L * r rows)
//   y[slice i] += B[slot][slice i] h[slice i]    (expand, added into the base output in place)
// Tokens are split between threads; within a thread, runs of consecutive tokens with one slot (the model runner
// orders the batch by slot) go in blocks that read each row of A and B once for the whole block.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t BLOCK = 8;  // tokens sharing each read of a row of A or B

// out[b] = w . v[b] for the block's nb rows v (stride ld), n floats each.
inline void block_dot(const float* w, const float* v, int64_t ld, int64_t nb, int64_t n, float* out) {
  Vec acc[BLOCK];
  for (int64_t b = 0; b < nb; ++b) acc[b] = Vec(0.f);
  int64_t k = 0;
  for (; k + Vec::size() <= n; k += Vec::size()) {
    const Vec wk = Vec::loadu(w + k);
    for (int64_t b = 0; b < nb; ++b) acc[b] = at::vec::fmadd(wk, Vec::loadu(v + b * ld + k), acc[b]);
  }
  if (k < n) {  // the tail: loadu with a count fills the rest with zeros
    const Vec wk = Vec::loadu(w + k, n - k);
    for (int64_t b = 0; b < nb; ++b) acc[b] = at::vec::fmadd(wk, Vec::loadu(v + b * ld + k, n - k), acc[b]);
  }
  for (int64_t b = 0; b < nb; ++b) out[b] = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, acc[b]);
}

template <typename scalar_t>
void lora_block(const scalar_t* x, int64_t x_stride, scalar_t* y, int64_t y_stride, int64_t nb, const float* a,
                const float* b, int64_t in, int64_t width, int64_t rank, const std::vector<int64_t>& slices,
                float* xf, float* h, float* dots) {
  for (int64_t t = 0; t < nb; ++t)
    for (int64_t k = 0; k < in; ++k) xf[t * in + k] = static_cast<float>(x[t * x_stride + k]);
  const int64_t rows = static_cast<int64_t>(slices.size()) * rank;
  for (int64_t r = 0; r < rows; ++r) {  // h[t, r] = A[r] . x[t]
    block_dot(a + r * in, xf, in, nb, in, dots);
    for (int64_t t = 0; t < nb; ++t) h[t * rows + r] = dots[t];
  }
  int64_t offset = 0;
  for (size_t i = 0; i < slices.size(); ++i) {  // y[t, n] += B[n, slice i's columns] . h[t, slice i]
    for (int64_t n = offset; n < offset + slices[i]; ++n) {
      block_dot(b + n * width + i * rank, h + i * rank, rows, nb, rank, dots);
      for (int64_t t = 0; t < nb; ++t) {
        scalar_t& out = y[t * y_stride + n];
        out = static_cast<scalar_t>(static_cast<float>(out) + dots[t]);
      }
    }
    offset += slices[i];
  }
}

}  // namespace

void lora_apply(const at::Tensor& x, at::Tensor& y, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const at::Tensor& token_slots, const at::Tensor& slot_ranks, at::IntArrayRef slice_sizes) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "lora_apply takes x [tokens, in] and y [tokens, out] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must share a dtype");
  TORCH_CHECK(lora_a.scalar_type() == at::kFloat && lora_b.scalar_type() == at::kFloat && lora_a.is_contiguous() &&
                  lora_b.is_contiguous() && lora_a.dim() == 3 && lora_b.dim() == 3,
              "lora_a [slots, L * R, in] and lora_b [slots, out, L * R] must be contiguous float32");
  const int64_t slots = lora_a.size(0), width = lora_a.size(1), in = lora_a.size(2), out = lora_b.size(1);
  const std::vector<int64_t> slices(slice_sizes.begin(), slice_sizes.end());
  int64_t total = 0;
  for (int64_t s : slices) total += s;
  TORCH_CHECK(x.size(1) == in && y.size(1) == out && total == out && lora_b.size(0) == slots &&
                  lora_b.size(2) == width && width % static_cast<int64_t>(slices.size()) == 0,
              "lora_apply: x, y, lora_a, lora_b and slice_sizes disagree in shape");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.is_contiguous() &&
                  token_slots.size(0) >= x.size(0) && slot_ranks.scalar_type() == at::kLong &&
                  slot_ranks.is_contiguous() && slot_ranks.size(0) == slots,
              "token_slots [tokens] and slot_ranks [slots] must be contiguous int64");
  const int64_t tokens = x.size(0), max_rank = width / static_cast<int64_t>(slices.size());
  const int64_t* slot_of = token_slots.data_ptr<int64_t>();
  const int64_t* rank_of = slot_ranks.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s) TORCH_CHECK(rank_of[s] >= 0 && rank_of[s] <= max_rank, "slot rank out of range");
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot_of[t] >= -1 && slot_of[t] < slots, "token slot out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_apply", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const float *ap = lora_a.data_ptr<float>(), *bp = lora_b.data_ptr<float>();
    const int64_t xs = x.stride(0), ys = y.stride(0);
    at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xf(BLOCK * in), h(BLOCK * width), dots(BLOCK);
      for (int64_t t = begin; t < end;) {
        const int64_t slot = slot_of[t];
        int64_t run_end = t + 1;
        while (run_end < end && run_end - t < BLOCK && slot_of[run_end] == slot) ++run_end;
        if (slot >= 0 && rank_of[slot] > 0)
          lora_block(xp + t * xs, xs, yp + t * ys, ys, run_end - t, ap + slot * width * in, bp + slot * out * width,
                     in, width, rank_of[slot], slices, xf.data(), h.data(), dots.data());
        t = run_end;
      }
    });
  });
}

TORCH_LIBRARY(llmmesh_lora, m) {
  m.def("lora_apply(Tensor x, Tensor(a!) y, Tensor lora_a, Tensor lora_b, Tensor token_slots, Tensor slot_ranks, "
        "int[] slice_sizes) -> ()");
  m.impl("lora_apply", c10::DispatchKey::CPU, &lora_apply);
}
