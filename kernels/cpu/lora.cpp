// Multi-LoRA on the CPU: one layer's whole adapter delta for a mixed batch in one call (the torch reference is
// kernels/lora.py's lora_shrink_ref and lora_expand_ref). The step's tokens come grouped by slot, once per step
// (kernels/lora.py's lora_kernel_meta, vLLM's LoRAKernelMeta): slot active_lora_ids[i] serves the tokens
// token_indices_sorted_by_lora_ids[lora_token_start_loc[i] : lora_token_start_loc[i + 1]], whatever their order in
// the batch; base-model tokens are in no group and get no delta. A slot holds one adapter's A [L * R, in] and B
// transposed, [R, out] (scaled), in float32, bfloat16 or float16, where L packed slices (q/k/v, gate/up) each have R
// rows of A ([i * R, (i + 1) * R) for slice i) and the i-th of slice_sizes columns of B; only the first r of a
// slice's R rows, r the slot's own rank, are read. Per token, in float32, for each slice i:
//   h = A[slot][i * R : i * R + r] x                     (shrink)
//   y[slice i] += sum over j < r of h[j] B[slot][j, slice i]   (expand, into the base output in place)
// A group is cut into blocks of up to BLOCK tokens, split between threads; a block reads each row of its A and B
// once, widened to float32 in registers, with its accumulators in registers: a decode batch with at most BLOCK
// tokens an adapter reads each adapter's weights once a layer, A and each slice of B as contiguous rows.
// With x and the slots in bfloat16, the groups of at least MM_MIN_TOKENS tokens of a step with MM_MIN_STEP_TOKENS
// such tokens (a prompt's) go instead through two matrix multiplies a block of up to MM_BLOCK tokens, on the CPU's
// matrix unit (AMX, through ATen's brgemm), h rounded to bfloat16 between them as vLLM's kernels round it; a
// decode's few tokens an adapter keep the vector path.

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>
#include <torch/library.h>

#ifdef __AVX512BW__
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t BLOCK = 8;
constexpr int64_t V = Vec::size();
constexpr int64_t PREFETCH_A = 1024;  // elements of A ahead of the shrink's reads
// The matrix-multiply path's smallest group and smallest step: below 128 tokens in all (one adapter's decode batch of
// 32 or 64) it measured slower than the vector path, its packing and set-up not paid back; above, faster.
constexpr int64_t MM_MIN_TOKENS = 16;
constexpr int64_t MM_MIN_STEP_TOKENS = 128;
constexpr int64_t MM_BLOCK = 64;
constexpr int64_t MM_TILE = 64;  // output columns a product at a time (the widest brgemm operand measured)

// n (<= V) values from p, widened to float32 (a bfloat16 is the top half of a float32: a shift).
template <typename w_t>
inline Vec load_w(const w_t* p, int64_t n) {
  if constexpr (std::is_same_v<w_t, float>) {
    return Vec::loadu(p, n);
  } else {
    Vec out;
    if (n == V) {
      at::vec::load_to_float<w_t>(p, out);
    } else {
      w_t tail[V] = {};
      std::copy(p, p + n, tail);
      at::vec::load_to_float<w_t>(tail, out);
    }
    return out;
  }
}

// y[0:len] += (d0, d1) (len <= 2 V), in y's dtype: a bfloat16 or float16 y is widened and rounded back by vectors.
template <typename scalar_t>
inline void add_into(scalar_t* y, const Vec& d0, const Vec& d1, int64_t len) {
  const int64_t len0 = std::min<int64_t>(V, len), len1 = len - len0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    (Vec::loadu(y, len0) + d0).store(y, len0);
    if (len1 > 0) (Vec::loadu(y + V, len1) + d1).store(y + V, len1);
  } else {
    const Vec y1 = len1 > 0 ? load_w(y + V, len1) : Vec(0.f);
    at::vec::convert_from_float<scalar_t>(load_w(y, len0) + d0, y1 + d1).store(y, len);
  }
}

// h[t * h_stride + j] = a[j] . x[t] for the block's NB tokens (xf: their rows in float32, `in` apart), rows j < rows
// of a. U vectors of a row at a time, each token with U accumulators. U is the same for every NB: a token's sum is
// then in one order however many tokens share its block (batch invariance).
template <int NB, typename w_t>
void shrink(const w_t* a, const float* xf, int64_t in, int64_t rows, float* h, int64_t h_stride) {
  constexpr int U = 2;
  for (int64_t j = 0; j < rows; ++j) {
    const w_t* aj = a + j * in;
    Vec acc[NB][U];
    for (int t = 0; t < NB; ++t)
      for (int u = 0; u < U; ++u) acc[t][u] = Vec(0.f);
    int64_t k = 0;
    for (; k + U * V <= in; k += U * V) {
      for (int64_t c = 0; c < U * V * static_cast<int64_t>(sizeof(w_t)); c += 64)  // a few rows ahead
        __builtin_prefetch(reinterpret_cast<const char*>(aj + k + PREFETCH_A) + c);
      for (int u = 0; u < U; ++u) {
        const Vec w = load_w(aj + k + u * V, V);
        for (int t = 0; t < NB; ++t) acc[t][u] = at::vec::fmadd(w, Vec::loadu(xf + t * in + k + u * V), acc[t][u]);
      }
    }
    for (; k < in; k += V) {  // the rest; a tail load fills the lanes past `in` with zeros
      const int64_t len = std::min<int64_t>(V, in - k);
      const Vec w = load_w(aj + k, len);
      for (int t = 0; t < NB; ++t) acc[t][0] = at::vec::fmadd(w, Vec::loadu(xf + t * in + k, len), acc[t][0]);
    }
    for (int t = 0; t < NB; ++t) {
      for (int u = 1; u < U; ++u) acc[t][0] = acc[t][0] + acc[t][u];
      h[t * h_stride + j] = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, acc[t][0]);
    }
  }
}

// y[tok[t], n0:n1] += sum_j h[t * h_stride + j] bt[j, n0:n1] over rows j < rows of bt, for the block's NB tokens;
// T vectors of outputs at a time (about 16 accumulators in registers), so each load of B serves every token and a
// row of B is read T vectors at a stretch.
template <int NB, typename scalar_t, typename w_t>
void expand(const w_t* bt, int64_t out, const float* h, int64_t h_stride, int64_t rows, int64_t n0, int64_t n1,
            scalar_t* y, int64_t y_stride, const int64_t* tok) {
  constexpr int T = NB <= 2 ? 8 : NB <= 4 ? 4 : 2;
  for (int64_t n = n0; n < n1; n += T * V) {
    int64_t len[T];
    for (int v = 0; v < T; ++v) len[v] = std::clamp<int64_t>(n1 - n - v * V, 0, V);
    Vec acc[NB][T];
    for (int t = 0; t < NB; ++t)
      for (int v = 0; v < T; ++v) acc[t][v] = Vec(0.f);
    for (int64_t j = 0; j < rows; ++j) {
      const w_t* bj = bt + j * out + n;
      // The row's next tile, read on the next pass over the rows: far enough ahead to be in cache by then.
      for (int64_t c = 0; c < T * V * static_cast<int64_t>(sizeof(w_t)); c += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(bj + T * V) + c);
      Vec b[T];
      for (int v = 0; v < T; ++v) b[v] = len[v] > 0 ? load_w(bj + v * V, len[v]) : Vec(0.f);
      for (int t = 0; t < NB; ++t) {
        const Vec ht(h[t * h_stride + j]);
        for (int v = 0; v < T; ++v) acc[t][v] = at::vec::fmadd(ht, b[v], acc[t][v]);
      }
    }
    for (int t = 0; t < NB; ++t)
      for (int v = 0; v < T && len[v] > 0; v += 2)  // T is even
        add_into(y + tok[t] * y_stride + n + v * V, acc[t][v], acc[t][v + 1], len[v] + len[v + 1]);
  }
}

template <int NB, typename scalar_t, typename w_t>
void lora_block(const scalar_t* x, int64_t x_stride, scalar_t* y, int64_t y_stride, const int64_t* tok, const w_t* a,
                const w_t* bt, int64_t in, int64_t out, int64_t max_rank, int64_t rank,
                const std::vector<int64_t>& slices, float* xf, float* h) {
  for (int t = 0; t < NB; ++t)
    for (int64_t k = 0; k < in; k += V) {
      const int64_t len = std::min<int64_t>(V, in - k);
      load_w(x + tok[t] * x_stride + k, len).store(xf + t * in + k, len);
    }
  const int64_t width = static_cast<int64_t>(slices.size()) * rank;  // h: each token's slices, rank values each
  for (size_t i = 0; i < slices.size(); ++i) shrink<NB>(a + i * max_rank * in, xf, in, rank, h + i * rank, width);
  int64_t offset = 0;
  for (size_t i = 0; i < slices.size(); ++i) {
    expand<NB>(bt, out, h + i * rank, width, rank, offset, offset + slices[i], y, y_stride, tok);
    offset += slices[i];
  }
}

template <typename scalar_t, typename w_t>
void run_block(int64_t nb, const scalar_t* x, int64_t x_stride, scalar_t* y, int64_t y_stride, const int64_t* tok,
               const w_t* a, const w_t* bt, int64_t in, int64_t out, int64_t max_rank, int64_t rank,
               const std::vector<int64_t>& slices, float* xf, float* h) {
#define LORA_BLOCK(NB) lora_block<NB>(x, x_stride, y, y_stride, tok, a, bt, in, out, max_rank, rank, slices, xf, h)
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


// The matrix-multiply path, for a block of m <= MM_BLOCK tokens of one slot, x and the slots in bfloat16. brgemm takes
// its right-hand operand [K, N] in VNNI pairs, [K / 2][N][2], packed here: for the shrink A's rows (K = in, even),
// for the expand B's (K = the rank rounded up to even, the row past it zero).
struct MMBuffers {
  std::vector<c10::BFloat16> xg, packed, hb;
  std::vector<float> h, c;
};

// packed[j / 2][c][j % 2] = b[j * ld + c] for j < rows, c < cols; rows j >= rows (up to k, even) are zero.
inline void pack_pairs(const c10::BFloat16* b, int64_t ld, int64_t rows, int64_t k, int64_t cols,
                       c10::BFloat16* packed) {
  static const c10::BFloat16 zeros[MM_TILE] = {};
  for (int64_t j = 0; j < k; j += 2, packed += 2 * cols) {
    const c10::BFloat16* r0 = b + j * ld;
    const c10::BFloat16* r1 = j + 1 < rows ? r0 + ld : zeros;
    int64_t c = 0;
#ifdef __AVX512BW__
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                        5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (; c + 32 <= cols; c += 32) {
      const __m512i v0 = _mm512_loadu_si512(r0 + c), v1 = _mm512_loadu_si512(r1 + c);
      _mm512_storeu_si512(packed + 2 * c, _mm512_permutex2var_epi16(v0, lo, v1));
      _mm512_storeu_si512(packed + 2 * c + 32, _mm512_permutex2var_epi16(v0, hi, v1));
    }
#endif
    for (; c < cols; ++c) {
      packed[2 * c] = r0[c];
      packed[2 * c + 1] = r1[c];
    }
  }
}

// y[0:n] += c[0:n], y in bfloat16.
inline void add_row(c10::BFloat16* y, const float* c, int64_t n) {
  for (int64_t k = 0; k < n; k += 2 * V) {
    const int64_t len = std::min<int64_t>(2 * V, n - k), len0 = std::min<int64_t>(V, len);
    add_into(y + k, Vec::loadu(c + k, len0), len > V ? Vec::loadu(c + k + V, len - V) : Vec(0.f), len);
  }
}

void mm_block(int64_t m, const c10::BFloat16* x, int64_t x_stride, c10::BFloat16* y, int64_t y_stride,
              const int64_t* tok, const c10::BFloat16* a, const c10::BFloat16* bt, int64_t in, int64_t out,
              int64_t max_rank, int64_t rank, const std::vector<int64_t>& slices, MMBuffers& buf) {
  using at::native::cpublas::brgemm;
  const int64_t num_slices = static_cast<int64_t>(slices.size()), width = num_slices * rank;
  const int64_t k2 = rank + rank % 2, width2 = num_slices * k2;  // h's columns, each slice's rank made even
  buf.xg.resize(m * in);
  buf.packed.resize(std::max(in, k2) * MM_TILE);
  buf.h.resize(m * width);
  buf.hb.resize(m * width2);
  for (int64_t t = 0; t < m; ++t) std::copy_n(x + tok[t] * x_stride, in, buf.xg.data() + t * in);
  // Shrink: h[:, i * rank + j] = x A[i * max_rank + j], the slices' rows packed together, up to MM_TILE at a time.
  for (int64_t n0 = 0; n0 < width; n0 += MM_TILE) {
    const int64_t nt = std::min(MM_TILE, width - n0);
    // The tile's column n is row j of slice i's A; a pair of its values is one 32-bit word.
    const uint32_t* rows[MM_TILE];
    for (int64_t n = 0; n < nt; ++n)
      rows[n] = reinterpret_cast<const uint32_t*>(a + ((n0 + n) / rank * max_rank + (n0 + n) % rank) * in);
    auto* packed = reinterpret_cast<uint32_t*>(buf.packed.data());
    for (int64_t kk = 0; kk < in / 2; ++kk, packed += nt)
      for (int64_t n = 0; n < nt; ++n) packed[n] = rows[n][kk];
    brgemm(m, nt, in, in, nt, width, false, buf.xg.data(), buf.packed.data(), buf.h.data() + n0, true);
  }
  for (int64_t t = 0; t < m; ++t)  // h in bfloat16, each slice's columns k2 apart
    for (int64_t i = 0; i < num_slices; ++i)
      for (int64_t j = 0; j < k2; ++j)
        buf.hb[t * width2 + i * k2 + j] = c10::BFloat16(j < rank ? buf.h[t * width + i * rank + j] : 0.f);
  // Expand: y[:, slice i] += h[:, slice i] B[:rank, slice i], into c MM_TILE columns at a time, then added into
  // each token's row of y in one pass (a column tile at a time over 64 rows of y would wait on memory).
  int64_t offset = 0;
  for (int64_t i = 0; i < num_slices; ++i) {
    const int64_t size = slices[i];
    buf.c.resize(m * size);
    for (int64_t c0 = 0; c0 < size; c0 += MM_TILE) {
      const int64_t nt = std::min(MM_TILE, size - c0);
      pack_pairs(bt + offset + c0, out, rank, k2, nt, buf.packed.data());
      brgemm(m, nt, k2, width2, nt, size, false, buf.hb.data() + i * k2, buf.packed.data(), buf.c.data() + c0, true);
    }
    for (int64_t t = 0; t < m; ++t) add_row(y + tok[t] * y_stride + offset, buf.c.data() + t * size, size);
    offset += size;
  }
}

// Calls f with a value of the C++ type of a float32, bfloat16 or float16 tensor.
template <typename F>
void dispatch_float(at::ScalarType type, const char* what, F f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, what, " must be float32, bfloat16 or float16, got ", type);
  }
}

}  // namespace

void lora_apply(const at::Tensor& x, at::Tensor& y, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const at::Tensor& token_indices_sorted_by_lora_ids, const at::Tensor& active_lora_ids,
                const at::Tensor& lora_token_start_loc, const at::Tensor& slot_ranks, at::IntArrayRef slice_sizes) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "lora_apply takes x [tokens, in] and y [tokens, out] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must share a dtype");
  TORCH_CHECK(lora_a.scalar_type() == lora_b.scalar_type() && lora_a.is_contiguous() && lora_b.is_contiguous() &&
                  lora_a.dim() == 3 && lora_b.dim() == 3,
              "lora_a [slots, L * R, in] and lora_b [slots, R, out] must be contiguous, of one dtype");
  const int64_t slots = lora_a.size(0), width = lora_a.size(1), in = lora_a.size(2), out = lora_b.size(2);
  const std::vector<int64_t> slices(slice_sizes.begin(), slice_sizes.end());
  int64_t total = 0;
  for (int64_t s : slices) total += s;
  TORCH_CHECK(!slices.empty() && x.size(1) == in && y.size(1) == out && total == out && lora_b.size(0) == slots &&
                  width == static_cast<int64_t>(slices.size()) * lora_b.size(1),
              "lora_apply: x, y, lora_a, lora_b and slice_sizes disagree in shape");
  const at::Tensor& sorted = token_indices_sorted_by_lora_ids;
  const int64_t groups = active_lora_ids.numel();
  for (const at::Tensor* t : {&sorted, &active_lora_ids, &lora_token_start_loc, &slot_ranks})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                "token_indices_sorted_by_lora_ids, active_lora_ids, lora_token_start_loc and slot_ranks must be "
                "contiguous int64 vectors");
  TORCH_CHECK(slot_ranks.size(0) == slots && lora_token_start_loc.size(0) == groups + 1,
              "slot_ranks must have one rank a slot and lora_token_start_loc one more entry than active_lora_ids");
  const int64_t tokens = x.size(0), max_rank = lora_b.size(1);
  const int64_t *tok = sorted.data_ptr<int64_t>(), *active = active_lora_ids.data_ptr<int64_t>();
  const int64_t *start = lora_token_start_loc.data_ptr<int64_t>(), *rank_of = slot_ranks.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s) TORCH_CHECK(rank_of[s] >= 0 && rank_of[s] <= max_rank, "slot rank out of range");
  for (int64_t i = 0; i < sorted.numel(); ++i)
    TORCH_CHECK(tok[i] >= 0 && tok[i] < tokens, "token index out of range");
  TORCH_CHECK(start[0] == 0 && start[groups] <= sorted.numel(), "lora_token_start_loc out of range");
  // The matrix-multiply path takes a step's groups of MM_MIN_TOKENS or more if they hold MM_MIN_STEP_TOKENS in all,
  // in blocks of up to MM_BLOCK tokens, fewer where that would leave a thread without work.
  int64_t mm_tokens = 0;
  for (int64_t g = 0; g < groups; ++g)
    if (start[g + 1] - start[g] >= MM_MIN_TOKENS) mm_tokens += start[g + 1] - start[g];
  const bool mm = x.scalar_type() == at::kBFloat16 && lora_a.scalar_type() == at::kBFloat16 && in % 2 == 0 &&
                  mm_tokens >= MM_MIN_STEP_TOKENS && at::native::cpublas::could_pack(at::kBFloat16);
  const int64_t threads = at::get_num_threads();
  const int64_t mm_size = std::clamp((mm_tokens + threads - 1) / threads, MM_MIN_TOKENS, MM_BLOCK);
  // The blocks: (slot, first position in the sorted tokens, tokens, whether by matrix multiplies), each group cut
  // into up to BLOCK tokens, or mm_size for the matrix-multiply path.
  std::vector<std::array<int64_t, 4>> blocks;
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(active[g] >= 0 && active[g] < slots, "active LoRA slot out of range");
    TORCH_CHECK(start[g] <= start[g + 1], "lora_token_start_loc must not decrease");
    if (rank_of[active[g]] == 0) continue;
    const bool by_mm = mm && start[g + 1] - start[g] >= MM_MIN_TOKENS;
    const int64_t block = by_mm ? mm_size : BLOCK;
    for (int64_t b = start[g]; b < start[g + 1]; b += block)
      blocks.push_back({active[g], b, std::min<int64_t>(block, start[g + 1] - b), by_mm});
  }
  dispatch_float(x.scalar_type(), "x", [&](auto x_type) {
    using scalar_t = decltype(x_type);
    dispatch_float(lora_a.scalar_type(), "lora_a", [&](auto w_type) {
      using w_t = decltype(w_type);
      const scalar_t* xp = x.data_ptr<scalar_t>();
      scalar_t* yp = y.data_ptr<scalar_t>();
      const w_t *ap = lora_a.data_ptr<w_t>(), *bp = lora_b.data_ptr<w_t>();
      const int64_t xs = x.stride(0), ys = y.stride(0);
      at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
        std::vector<float> xf(BLOCK * in), h(BLOCK * width);
        MMBuffers buf;
        bool used_mm = false;
        for (int64_t i = begin; i < end; ++i) {
          const auto [slot, first, count, by_mm] = blocks[i];
          const w_t *a_slot = ap + slot * width * in, *b_slot = bp + slot * max_rank * out;
          if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<w_t, c10::BFloat16>) {
            if (by_mm) {
              mm_block(count, xp, xs, yp, ys, tok + first, a_slot, b_slot, in, out, max_rank, rank_of[slot], slices,
                       buf);
              used_mm = true;
              continue;
            }
          }
          run_block(count, xp, xs, yp, ys, tok + first, a_slot, b_slot, in, out, max_rank, rank_of[slot], slices,
                    xf.data(), h.data());
        }
        if (used_mm) at::native::cpublas::brgemm_release();
      });
    });
  });
}

TORCH_LIBRARY(llmmesh_lora, m) {
  m.def("lora_apply(Tensor x, Tensor(a!) y, Tensor lora_a, Tensor lora_b, Tensor token_indices_sorted_by_lora_ids, "
        "Tensor active_lora_ids, Tensor lora_token_start_loc, Tensor slot_ranks, int[] slice_sizes) -> ()");
  m.impl("lora_apply", c10::DispatchKey::CPU, &lora_apply);
}
