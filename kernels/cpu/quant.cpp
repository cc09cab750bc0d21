// Group-wise quantized matrix-vector products for a decode step's few rows, in kernels/quant.py's format:
// int8 codes q [N, K], float32 scales and zeros [N, K / group], w[n, k] = q[n, k] * scale + zero. One pass over
// the codes (a byte a weight, the whole row in cache for every input row), float32 arithmetic throughout:
//   out[m, n] = sum_g scale[n, g] * (q[n, g] . x[m, g]) + zero[n, g] * sum(x[m, g]).
// PyTorch's kernels take no int8 codes in groups (its int8 one wants one scale per row), so without this GGUF's
// Q8_0 and Q6_K layers ran on their dequantized bfloat16 copy, twice the bytes a decode step reads.
// Registered as torch.ops.llmmesh_quant.group_gemv when the library loads (kernels/quant.py calls it).

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <torch/extension.h>
#include <torch/library.h>

namespace {

// Up to ROWS input rows against one output's codes: each group's codes are widened to float once and used by
// every row. out[m] = sum_g scale[g] * (q[g] . x[m, g]) + zero[g] * xsum[m, g]. Two accumulators a row (even and
// odd groups) halve the chain of dependent multiply-adds, which bounded the loop.
template <int GROUP, int ROWS>
inline void rows_dot(const int8_t* q, const float* x, int64_t k, const float* scales, const float* zeros,
                     const float* xsum, int64_t groups, float* out, int64_t out_stride) {
  float sums[ROWS];
#if defined(__AVX512F__)
  __m512 acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* qg = q + g * GROUP;
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qg)));
    __m512 w1 = w0;
    if constexpr (GROUP == 32) w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qg + 16))));
    const __m512 scale = _mm512_set1_ps(scales[g]);
    for (int m = 0; m < ROWS; ++m) {
      const float* xg = x + m * k + g * GROUP;
      __m512 dot = _mm512_mul_ps(w0, _mm512_loadu_ps(xg));
      if constexpr (GROUP == 32) dot = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + 16), dot);
      acc[m][g & 1] = _mm512_fmadd_ps(dot, scale, acc[m][g & 1]);
    }
  }
  for (int m = 0; m < ROWS; ++m) sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
#else
  for (int m = 0; m < ROWS; ++m) {
    sums[m] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      float dot = 0.f;
      for (int i = 0; i < GROUP; ++i) dot += static_cast<float>(q[g * GROUP + i]) * x[m * k + g * GROUP + i];
      sums[m] += scales[g] * dot;
    }
  }
#endif
  for (int m = 0; m < ROWS; ++m) {
    float zero_terms = 0.f;
    for (int64_t g = 0; g < groups; ++g) zero_terms += zeros[g] * xsum[m * groups + g];
    out[m * out_stride] = sums[m] + zero_terms;
  }
}

template <int GROUP>
void gemv(const int8_t* q, const float* x, const float* scales, const float* zeros, const float* xsum, float* out,
          int64_t rows, int64_t n, int64_t k) {
  const int64_t groups = k / GROUP;
  at::parallel_for(0, n, 512, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int8_t* qi = q + i * k;
      const float *si = scales + i * groups, *zi = zeros + i * groups;
      for (int64_t m = 0; m < rows; m += 4) {
        const float *xm = x + m * k, *xs = xsum + m * groups;
        float* o = out + m * n + i;
        switch (std::min<int64_t>(rows - m, 4)) {
          case 1: rows_dot<GROUP, 1>(qi, xm, k, si, zi, xs, groups, o, n); break;
          case 2: rows_dot<GROUP, 2>(qi, xm, k, si, zi, xs, groups, o, n); break;
          case 3: rows_dot<GROUP, 3>(qi, xm, k, si, zi, xs, groups, o, n); break;
          default: rows_dot<GROUP, 4>(qi, xm, k, si, zi, xs, groups, o, n);
        }
      }
    }
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
