// Group-wise quantized matrix-vector products for a decode step's few rows, in kernels/quant.py's format:
// int8 codes q [N, K], float32 scales and zeros [N, K / group], w[n, k] = q[n, k] * scale + zero. One pass over
// the codes (a byte a weight, the whole row in cache for every input row), float32 arithmetic throughout:
//   out[m, n] = sum_g scale[n, g] * (q[n, g] . x[m, g]) + zero[n, g] * sum(x[m, g]).
// PyTorch's kernels take no int8 codes in groups (its int8 one wants one scale per row), so without this GGUF's
// Q8_0 and Q6_K layers ran on their dequantized bfloat16 copy, twice the bytes a decode step reads.
// Registered as torch.ops.llmmesh_quant.group_gemv when the library loads (kernels/quant.py calls it).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>
#include <torch/library.h>

namespace {

#if defined(__AVX512F__)
// scale * (q . x) over one group, added to acc; GROUP is 16 or 32.
template <int GROUP>
inline __m512 group_fma(const int8_t* q, const float* x, float scale, __m512 acc) {
  __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q))),
                             _mm512_loadu_ps(x));
  if constexpr (GROUP == 32) {
    __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16))));
    dot = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + 16), dot);
  }
  return _mm512_fmadd_ps(dot, _mm512_set1_ps(scale), acc);
}
#endif

// One output: sum over groups of scale * (q . x) + zero * sum(x).
template <int GROUP>
inline float row_dot(const int8_t* q, const float* x, const float* scales, const float* zeros, const float* xsum,
                     int64_t groups) {
  float acc = 0.f;
#if defined(__AVX512F__)
  __m512 vacc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) vacc = group_fma<GROUP>(q + g * GROUP, x + g * GROUP, scales[g], vacc);
  acc = _mm512_reduce_add_ps(vacc);
#else
  for (int64_t g = 0; g < groups; ++g) {
    float dot = 0.f;
    for (int k = 0; k < GROUP; ++k) dot += static_cast<float>(q[g * GROUP + k]) * x[g * GROUP + k];
    acc += scales[g] * dot;
  }
#endif
  for (int64_t g = 0; g < groups; ++g) acc += zeros[g] * xsum[g];
  return acc;
}

template <int GROUP>
void gemv(const int8_t* q, const float* x, const float* scales, const float* zeros, const float* xsum, float* out,
          int64_t rows, int64_t n, int64_t k) {
  const int64_t groups = k / GROUP;
  at::parallel_for(0, n, 512, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t m = 0; m < rows; ++m)
        out[m * n + i] = row_dot<GROUP>(q + i * k, x + m * k, scales + i * groups, zeros + i * groups,
                                        xsum + m * groups, groups);
  });
}

}  // namespace

at::Tensor group_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "group_gemv takes x [M, K] and q [N, K]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8 codes");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && zeros.sizes() == scales.sizes() &&
                  zeros.scalar_type() == at::kFloat && zeros.is_contiguous() && scales.size(0) == q.size(0),
              "scales and zeros must be contiguous float32 [N, groups]");
  const int64_t rows = x.size(0), n = q.size(0), k = q.size(1), groups = scales.size(1);
  TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups == 16 || k / groups == 32),
              "group_gemv takes groups of 16 or 32");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor xsum = xf.view({rows, groups, k / groups}).sum(-1).contiguous();
  at::Tensor out = at::empty({rows, n}, xf.options());
  auto run = k / groups == 32 ? gemv<32> : gemv<16>;
  run(q.data_ptr<int8_t>(), xf.data_ptr<float>(), scales.data_ptr<float>(), zeros.data_ptr<float>(),
      xsum.data_ptr<float>(), out.data_ptr<float>(), rows, n, k);
  return out.to(x.scalar_type());
}

TORCH_LIBRARY(llmmesh_quant, m) { m.def("group_gemv", &group_gemv); }
