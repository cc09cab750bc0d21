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
#include <cstring>
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

// ---------------------------------------------------------------------------------------------------------------
// int8_dot_linear: 4-bit or 8-bit codes in groups of 32 against activations quantized to int8, as llama.cpp's
// Q4_1 x Q8_1 dot products. Each input row is quantized once per call, per block of 32: xd = absmax / 127,
// xq = round(x / xd), xs = xd * sum(xq). A weight w = u * d + m (u the unsigned code) then gives, per block,
//   w . x^ = d * xd * (u . xq) + m * xs,
// with u . xq an exact integer dot product (AVX512-VNNI's vpdpbusd: unsigned bytes times signed bytes).
// Packed layout (kernels/quant.py's pack_int8_dot): output columns in tiles of 16, one int32 lane a column, each
// tile's groups one after another, so a layer is one sequential stream; a group of a tile is
//   4-bit: 4 chunks of 64 bytes; in chunk c, byte 4 * j + i holds column j's codes k = 8c + i (low nibble) and
//          8c + 4 + i (high nibble);
//   8-bit: 8 chunks of 64 bytes; in chunk c, byte 4 * j + i holds column j's code k = 4c + i plus 128 (unsigned;
//          the zero moves by -128 d);
// then the 16 columns' scales d and zeros m, float16 (GGUF's own; 20 bytes a 4-bit block, as Q4_1's).

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t TILE = 16;
constexpr int64_t PREFETCH_BYTES = 2048;  // ahead of the group being read: a single stream, prefetched early

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)

inline __m512 load_floats(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_floats(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline void store_floats(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
inline void store_floats(at::BFloat16* p, __m512 v, __mmask16 mask) {
  // Round to nearest even, as torch's float -> bfloat16.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// xq [rows, k], xd and xs [rows, k / 32] (see above).
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int8_t* xq, float* xd, float* xs) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t b = 0; b < rows * k / BLOCK; ++b) {
    const __m512 lo = load_floats(x + b * BLOCK), hi = load_floats(x + b * BLOCK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
    const float d = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inverse)));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inverse)));
    _mm_storeu_si128((__m128i*)(xq + b * BLOCK), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128((__m128i*)(xq + b * BLOCK + 16), _mm512_cvtsepi32_epi8(qhi));
    xd[b] = d;
    xs[b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  }
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// ROWS input rows against one tile of 16 columns. One or two rows keep four integer accumulators each (even and
// odd chunks, low and high nibbles), so vpdpbusd's dependent chains stay short; more rows overlap their own. The
// integer sums are exact in any order; the float sum over groups is one chain, in group order, for every ROWS: a
// row's output does not depend on how many rows share the call (batch invariance).
template <int BITS, int ROWS, typename T>
inline void tile_rows(const uint8_t* tile, int64_t groups, const int8_t* xq, const float* xd, const float* xs,
                      int64_t k, T* out, int64_t n, int64_t col) {
  constexpr int CHUNKS = BITS == 4 ? 4 : 8, SPLIT = ROWS <= 2 ? 2 : 1;
  constexpr int64_t GROUP_BYTES = CHUNKS * 64 + 2 * TILE * 2;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = tile + g * GROUP_BYTES;
    for (int64_t line = 0; line < GROUP_BYTES; line += 64) _mm_prefetch(group + PREFETCH_BYTES + line, _MM_HINT_T0);
    __m512i dot[ROWS][2 * SPLIT];
    for (int r = 0; r < ROWS; ++r)
      for (int s = 0; s < 2 * SPLIT; ++s) dot[r][s] = _mm512_setzero_si512();
    const int8_t* xg = xq + g * BLOCK;
    for (int c = 0; c < CHUNKS; ++c) {
      const __m512i raw = _mm512_loadu_si512(group + c * 64);
      if constexpr (BITS == 4) {
        const __m512i low = _mm512_and_si512(raw, nibble);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        const int s = 2 * (c % SPLIT);
        for (int r = 0; r < ROWS; ++r) {
          dot[r][s] = _mm512_dpbusd_epi32(dot[r][s], low, broadcast4(xg + r * k + 8 * c));
          dot[r][s + 1] = _mm512_dpbusd_epi32(dot[r][s + 1], high, broadcast4(xg + r * k + 8 * c + 4));
        }
      } else {
        const int s = c % (2 * SPLIT);
        for (int r = 0; r < ROWS; ++r) dot[r][s] = _mm512_dpbusd_epi32(dot[r][s], raw, broadcast4(xg + r * k + 4 * c));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(group + CHUNKS * 64)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(group + CHUNKS * 64 + 2 * TILE)));
    for (int r = 0; r < ROWS; ++r) {
      __m512i total = _mm512_add_epi32(dot[r][0], dot[r][1]);
      if constexpr (SPLIT == 2) total = _mm512_add_epi32(total, _mm512_add_epi32(dot[r][2], dot[r][3]));
      __m512& a = acc[r];
      a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, _mm512_set1_ps(xd[r * groups + g])), a);
      a = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * groups + g]), a);
    }
  }
  const __mmask16 mask = col + TILE <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - col)) - 1);
  for (int r = 0; r < ROWS; ++r) store_floats(out + r * n + col, acc[r], mask);
}

// Each task takes four tiles (a few KB) and runs every row over them, eight rows at a time: the second eight read
// the tiles from L1, not memory.
template <int BITS, typename T>
void int8_dot(const uint8_t* packed, int64_t tiles, int64_t groups, const int8_t* xq, const float* xd,
              const float* xs, int64_t rows, int64_t k, T* out, int64_t n) {
  constexpr int64_t TILES_A_TASK = 4;
  const int64_t tile_bytes = groups * ((BITS == 4 ? 4 : 8) * 64 + 2 * TILE * 2);
  at::parallel_for(0, (tiles + TILES_A_TASK - 1) / TILES_A_TASK, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin * TILES_A_TASK; t < std::min(end * TILES_A_TASK, tiles); t += TILES_A_TASK) {
      for (int64_t m = 0; m < rows; m += 8) {
        for (int64_t i = t; i < std::min(t + TILES_A_TASK, tiles); ++i) {
          const uint8_t* tile = packed + i * tile_bytes;
          const int8_t* xm = xq + m * k;
          const float *dm = xd + m * groups, *sm = xs + m * groups;
          T* o = out + m * n;
          switch (std::min<int64_t>(rows - m, 8)) {
#define ROWS_CASE(R) \
  case R: tile_rows<BITS, R>(tile, groups, xm, dm, sm, k, o, n, i * TILE); break;
            ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
#undef ROWS_CASE
          }
        }
      }
    }
  });
}

template <typename T>
void int8_dot_linear_typed(const at::Tensor& x, const at::Tensor& packed, at::Tensor& out, int bits) {
  const int64_t rows = x.size(0), k = x.size(1), n = out.size(1), tiles = packed.size(0), groups = packed.size(1);
  at::Tensor xq = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor xd = at::empty({rows, groups}, x.options().dtype(at::kFloat)), xs = at::empty_like(xd);
  quantize_rows(x.data_ptr<T>(), rows, k, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>());
  auto run = bits == 4 ? int8_dot<4, T> : int8_dot<8, T>;
  run(packed.data_ptr<uint8_t>(), tiles, groups, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>(),
      rows, k, out.data_ptr<T>(), n);
}

#endif

}  // namespace

bool int8_dot_supported() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 or bfloat16, the packed weight [tiles, K / 32, 320 (4-bit) or 576 (8-bit) bytes], of which n
// columns are real. Returns x @ w.T [M, n] in x's dtype.
at::Tensor int8_dot_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(int8_dot_supported(), "int8_dot_linear needs AVX512-VNNI");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  (packed.size(2) == 320 || packed.size(2) == 576),
              "the weight must be packed by kernels/quant.py's pack_int8_dot");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1) * BLOCK, "x must be [M, 32 * groups]");
  TORCH_CHECK(n > (packed.size(0) - 1) * TILE && n <= packed.size(0) * TILE, "n must fall in the last tile");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int bits = packed.size(2) == 320 ? 4 : 8;
  if (x.scalar_type() == at::kBFloat16) {
    int8_dot_linear_typed<at::BFloat16>(xc, packed, out, bits);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32 or bfloat16");
    int8_dot_linear_typed<float>(xc, packed, out, bits);
  }
#endif
  return out;
}

TORCH_LIBRARY(llmmesh_quant, m) {
  m.def("group_gemv", &group_gemv);
  m.def("int8_dot_supported", &int8_dot_supported);
  m.def("int8_dot_linear", &int8_dot_linear);
}
