// Multi-LoRA on the CPU: one layer's whole adapter delta for a mixed batch in one call (the torch reference is
// kernels/lora.py's lora_shrink_ref and lora_expand_ref). Token t uses slot token_slots[t] (-1: the base model, no
// delta). A slot holds one adapter's A [L * R, in] and B transposed, [L * R, out] (scaled), where L packed slices
// (q/k/v, gate/up) stack their rows by the slot's own rank r: slice i's rows are [i * r, (i + 1) * r) of both, and
// its outputs the i-th of slice_sizes (B is zero outside them, and never read there). Per token, in float32:
//   h = A[slot] x                                         (shrink: only the adapter's L * r rows)
//   y[slice i] += sum over slice i's rows j of h[j] B[slot][j, slice i]   (expand, into the base output in place)
// Tokens are split between threads; a run of up to BLOCK consecutive tokens with one slot (the model runner orders
// the batch by slot) reads each row of A and B once, its accumulators in registers.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t BLOCK = 8;
constexpr int64_t V = Vec::size();

// h[t, j] = a[j] . x[t] for the block's NB tokens (xf: their rows in float32, `in` apart), rows j of a.
template <int NB>
void shrink(const float* a, const float* xf, int64_t in, int64_t rows, float* h) {
  for (int64_t j = 0; j < rows; ++j) {
    const float* aj = a + j * in;
    Vec acc[NB];
    for (int t = 0; t < NB; ++t) acc[t] = Vec(0.f);
    int64_t k = 0;
    for (; k + V <= in; k += V) {
      const Vec w = Vec::loadu(aj + k);
      for (int t = 0; t < NB; ++t) acc[t] = at::vec::fmadd(w, Vec::loadu(xf + t * in + k), acc[t]);
    }
    if (k < in) {  // the tail: a load with a count fills the rest with zeros
      const Vec w = Vec::loadu(aj + k, in - k);
      for (int t = 0; t < NB; ++t) acc[t] = at::vec::fmadd(w, Vec::loadu(xf + t * in + k, in - k), acc[t]);
    }
    for (int t = 0; t < NB; ++t)
      h[t * rows + j] = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, acc[t]);
  }
}

// y[t, n0:n1] += sum_j h[t, j] bt[j, n0:n1] over rows j0..j1 of bt, for the block's NB tokens; two vectors of
// outputs at a time, so each load of B serves every token.
template <int NB, typename scalar_t>
void expand(const float* bt, int64_t out, const float* h, int64_t rows, int64_t j0, int64_t j1, int64_t n0, int64_t n1,
            scalar_t* y, int64_t y_stride) {
  for (int64_t n = n0; n < n1; n += 2 * V) {
    const int64_t len = std::min<int64_t>(2 * V, n1 - n), len0 = std::min<int64_t>(V, len), len1 = len - len0;
    Vec acc[NB][2];
    for (int t = 0; t < NB; ++t) acc[t][0] = acc[t][1] = Vec(0.f);
    for (int64_t j = j0; j < j1; ++j) {
      const float* bj = bt + j * out + n;
      const Vec b0 = Vec::loadu(bj, len0), b1 = len1 > 0 ? Vec::loadu(bj + V, len1) : Vec(0.f);
      for (int t = 0; t < NB; ++t) {
        const Vec ht(h[t * rows + j]);
        acc[t][0] = at::vec::fmadd(ht, b0, acc[t][0]);
        acc[t][1] = at::vec::fmadd(ht, b1, acc[t][1]);
      }
    }
    float delta[2 * V];
    for (int t = 0; t < NB; ++t) {
      acc[t][0].store(delta);
      acc[t][1].store(delta + V);
      scalar_t* yt = y + t * y_stride + n;
      for (int64_t i = 0; i < len; ++i) yt[i] = static_cast<scalar_t>(static_cast<float>(yt[i]) + delta[i]);
    }
  }
}

template <int NB, typename scalar_t>
void lora_block(const scalar_t* x, int64_t x_stride, scalar_t* y, int64_t y_stride, const float* a, const float* bt,
                int64_t in, int64_t out, int64_t rank, const std::vector<int64_t>& slices, float* xf, float* h) {
  for (int t = 0; t < NB; ++t)
    for (int64_t k = 0; k < in; ++k) xf[t * in + k] = static_cast<float>(x[t * x_stride + k]);
  const int64_t rows = static_cast<int64_t>(slices.size()) * rank;
  shrink<NB>(a, xf, in, rows, h);
  int64_t offset = 0;
  for (size_t i = 0; i < slices.size(); ++i) {
    expand<NB>(bt, out, h, rows, i * rank, (i + 1) * rank, offset, offset + slices[i], y, y_stride);
    offset += slices[i];
  }
}

template <typename scalar_t>
void run_block(int64_t nb, const scalar_t* x, int64_t x_stride, scalar_t* y, int64_t y_stride, const float* a,
               const float* bt, int64_t in, int64_t out, int64_t rank, const std::vector<int64_t>& slices, float* xf,
               float* h) {
#define LORA_BLOCK(NB) lora_block<NB>(x, x_stride, y, y_stride, a, bt, in, out, rank, slices, xf, h)
  switch (nb) {
    case 1: LORA_BLOCK(1); break;
    case 2: LORA_BLOCK(2); break;
    case 3: LORA_BLOCK(3); break;
    case 4: LORA_BLOCK(4); break;
    case 5: LORA_BLOCK(5); break;
    case 6: LORA_BLOCK(6); break;
    case 7: LORA_BLOCK(7); break;
    default: LORA_BLOCK(8);
  }
#undef LORA_BLOCK
}

}  // namespace

void lora_apply(const at::Tensor& x, at::Tensor& y, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const at::Tensor& token_slots, const at::Tensor& slot_ranks, at::IntArrayRef slice_sizes) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "lora_apply takes x [tokens, in] and y [tokens, out] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must share a dtype");
  TORCH_CHECK(lora_a.scalar_type() == at::kFloat && lora_b.scalar_type() == at::kFloat && lora_a.is_contiguous() &&
                  lora_b.is_contiguous() && lora_a.dim() == 3 && lora_b.dim() == 3,
              "lora_a [slots, L * R, in] and lora_b [slots, L * R, out] must be contiguous float32");
  const int64_t slots = lora_a.size(0), width = lora_a.size(1), in = lora_a.size(2), out = lora_b.size(2);
  const std::vector<int64_t> slices(slice_sizes.begin(), slice_sizes.end());
  int64_t total = 0;
  for (int64_t s : slices) total += s;
  TORCH_CHECK(!slices.empty() && x.size(1) == in && y.size(1) == out && total == out && lora_b.size(0) == slots &&
                  lora_b.size(1) == width && width % static_cast<int64_t>(slices.size()) == 0,
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
      std::vector<float> xf(BLOCK * in), h(BLOCK * width);
      for (int64_t t = begin; t < end;) {
        const int64_t slot = slot_of[t];
        int64_t run_end = t + 1;
        while (run_end < end && run_end - t < BLOCK && slot_of[run_end] == slot) ++run_end;
        if (slot >= 0 && rank_of[slot] > 0)
          run_block(run_end - t, xp + t * xs, xs, yp + t * ys, ys, ap + slot * width * in, bp + slot * width * out,
                    in, out, rank_of[slot], slices, xf.data(), h.data());
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
