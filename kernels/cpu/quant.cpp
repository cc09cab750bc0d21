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
// with u . xq an exact integer dot product of unsigned bytes and signed bytes (AVX512-VNNI's vpdpbusd, or AVX2's
// vpmaddubsw and vpmaddwd).
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

// Four activation codes as one int32, to broadcast to every lane.
inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The vector width of the kernel compiled here, if any.
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_DOT 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INT8_DOT 256
#endif

#if INT8_DOT == 512

// Rows a tile is run over at once: eight rows' accumulators fit the 32 registers.
constexpr int64_t ROWS_A_RUN = 8;

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

// xq [rows, k], xd, xs and xsum (the integer sum of a block's xq) [rows, k / 32] (see above).
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int8_t* xq, float* xd, float* xs, int32_t* xsum) {
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
    xsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    xs[b] = d * static_cast<float>(xsum[b]);
  }
}

inline __m512i broadcast4(const int8_t* p) { return _mm512_set1_epi32(four_bytes(p)); }

// ROWS input rows against one tile of 16 columns. One or two rows keep four integer accumulators each (even and
// odd chunks, low and high nibbles), so vpdpbusd's dependent chains stay short; more rows overlap their own. The
// integer sums are exact in any order; the float sum over groups is one chain, in group order, for every ROWS: a
// row's output does not depend on how many rows share the call (batch invariance).
template <int BITS, int ROWS, typename T>
inline void tile_rows(const uint8_t* tile, int64_t groups, const int8_t* xq, const float* xd, const float* xs,
                      const int32_t*, int64_t k, T* out, int64_t n, int64_t col) {
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

#elif INT8_DOT == 256

// AVX2 (+FMA, F16C): a tile's 16 columns are two halves of 8 int32 lanes, and the unsigned x signed byte products
// are vpmaddubsw's (int16 pairs, saturating) widened by vpmaddwd, as llama.cpp's AVX2 dot products. Rows a tile is
// run over at once: four rows' accumulators and the codes fill the 16 registers.
constexpr int64_t ROWS_A_RUN = 4;

inline __m256 load_floats(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_floats(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline void store_floats(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store_floats(at::BFloat16* p, __m256 v) {
  // Round to nearest even, as torch's float -> bfloat16.
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256i high = _mm256_srli_epi32(rounded, 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8);
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}

// Horizontal sums and maxima of AVX2 vectors.
inline float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t reduce_add(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// xq [rows, k], xd, xs and xsum (the integer sum of a block's xq) [rows, k / 32] (see above).
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int8_t* xq, float* xd, float* xs, int32_t* xsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < rows * k / BLOCK; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load_floats(x + b * BLOCK + 8 * i);
    const __m256 abs01 = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
    const __m256 abs23 = _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]));
    const float amax = reduce_max(_mm256_max_ps(abs01, abs23));
    const float d = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
    // Saturating packs interleave the 128-bit lanes; the permute puts the 32 codes back in order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)(xq + b * BLOCK), _mm256_max_epi8(ordered, _mm256_set1_epi8(-127)));
    xd[b] = d;
    xsum[b] = reduce_add(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    xs[b] = d * static_cast<float>(xsum[b]);
  }
}

inline __m256i broadcast4(const int8_t* p) { return _mm256_set1_epi32(four_bytes(p)); }

// count (at most 8) columns of v to p: the last tile's may be part empty, and those go through a buffer.
template <typename T>
inline void store_columns(T* p, __m256 v, int64_t count) {
  if (count == 8) {
    store_floats(p, v);
  } else if (count > 0) {
    T buffer[8];
    store_floats(buffer, v);
    std::copy(buffer, buffer + count, p);
  }
}

// One row of 4-bit codes (a batch-1 decode) against a tile in one pass: both halves' sums side by side, each the
// same operations in the same order as tile_rows's (below), so the second half's arithmetic overlaps the tile's stream
// from memory instead of following it (one row needs few registers).
template <typename T>
inline void tile_row_4bit(const uint8_t* tile, int64_t groups, const int8_t* xq, const float* xd, const float* xs,
                          T* out, int64_t n, int64_t col) {
  constexpr int64_t GROUP_BYTES = 4 * 64 + 2 * TILE * 2;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = tile + g * GROUP_BYTES;
    for (int64_t line = 0; line < GROUP_BYTES; line += 64) _mm_prefetch(group + PREFETCH_BYTES + line, _MM_HINT_T0);
    __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    const int8_t* xg = xq + g * BLOCK;
#pragma GCC unroll 1
    for (int c = 0; c < 4; ++c) {
      const __m256i xl = broadcast4(xg + 8 * c), xh = broadcast4(xg + 8 * c + 4);
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(group + c * 64 + 32 * h));
        const __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(raw, nibble), xl);
        const __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble), xh);
        dot[h] = _mm256_add_epi16(dot[h], _mm256_add_epi16(lo, hi));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const uint8_t* scales = group + 4 * 64 + 16 * h;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)scales));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales + 2 * TILE)));
      const __m256i total = _mm256_madd_epi16(dot[h], ones);
      acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(xd[g])), acc[h]);
      acc[h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[g]), acc[h]);
    }
  }
  for (int h = 0; h < 2; ++h) store_columns(out + col + 8 * h, acc[h], std::min<int64_t>(8, n - col - 8 * h));
}

// ROWS input rows against one tile of 16 columns, the same sums as the AVX-512 tile_rows above, one half of the
// tile (8 columns) at a time: a half's accumulators fit the 16 registers, and the second half reads the tile from
// L1. The float sum over groups is one chain, in group order, for every ROWS (batch invariance). The integer sums
// are exact: 4-bit codes (0..15) times |xq| <= 127 add up in int16 lanes (16 products a lane: at most 30480)
// before widening; 8-bit codes would saturate vpmaddubsw as unsigned bytes (255 * 127 * 2), so they go signed,
// w = u - 128, as |w| * (xq with w's sign), and u . xq = w . xq + 128 * sum(xq) puts the 128 back.
template <int BITS, int ROWS, typename T>
inline void tile_rows(const uint8_t* tile, int64_t groups, const int8_t* xq, const float* xd, const float* xs,
                      const int32_t* xsum, int64_t k, T* out, int64_t n, int64_t col) {
  if constexpr (BITS == 4 && ROWS == 1) return tile_row_4bit(tile, groups, xq, xd, xs, out, n, col);
  constexpr int CHUNKS = BITS == 4 ? 4 : 8;
  constexpr int64_t GROUP_BYTES = CHUNKS * 64 + 2 * TILE * 2;
  const __m256i nibble = _mm256_set1_epi8(0x0F), bias = _mm256_set1_epi8(-128), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* group = tile + g * GROUP_BYTES;
      if (h == 0)
        for (int64_t line = 0; line < GROUP_BYTES; line += 64) _mm_prefetch(group + PREFETCH_BYTES + line, _MM_HINT_T0);
      __m256i dot[ROWS];  // int16 lanes (4-bit) or int32 (8-bit)
      for (int r = 0; r < ROWS; ++r) dot[r] = _mm256_setzero_si256();
      const int8_t* xg = xq + g * BLOCK;
      // Not unrolled: unrolled, GCC computes every chunk's products before adding them and spills them.
#pragma GCC unroll 1
      for (int c = 0; c < CHUNKS; ++c) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(group + c * 64 + 32 * h));
        if constexpr (BITS == 4) {
          const __m256i low = _mm256_and_si256(raw, nibble);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
          for (int r = 0; r < ROWS; ++r) {
            const __m256i lo = _mm256_maddubs_epi16(low, broadcast4(xg + r * k + 8 * c));
            const __m256i hi = _mm256_maddubs_epi16(high, broadcast4(xg + r * k + 8 * c + 4));
            dot[r] = _mm256_add_epi16(dot[r], _mm256_add_epi16(lo, hi));
          }
        } else {
          const __m256i w = _mm256_xor_si256(raw, bias);
          const __m256i magnitude = _mm256_abs_epi8(w);
          for (int r = 0; r < ROWS; ++r) {
            const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(broadcast4(xg + r * k + 4 * c), w));
            dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
      const uint8_t* scales = group + CHUNKS * 64 + 16 * h;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)scales));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales + 2 * TILE)));
      for (int r = 0; r < ROWS; ++r) {
        const __m256i total = BITS == 4 ? _mm256_madd_epi16(dot[r], ones)
                                        : _mm256_add_epi32(dot[r], _mm256_set1_epi32(128 * xsum[r * groups + g]));
        __m256& a = acc[r];
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(xd[r * groups + g])), a);
        a = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * groups + g]), a);
      }
    }
    const int64_t first = col + 8 * h, count = std::min<int64_t>(8, n - first);
    for (int r = 0; r < ROWS; ++r) store_columns(out + r * n + first, acc[r], count);
  }
}

#endif

#if defined(INT8_DOT)

// Each task takes four tiles (a few KB) and runs every row over them, ROWS_A_RUN rows at a time: the next rows read
// the tiles from L1, not memory.
template <int BITS, typename T>
void int8_dot(const uint8_t* packed, int64_t tiles, int64_t groups, const int8_t* xq, const float* xd,
              const float* xs, const int32_t* xsum, int64_t rows, int64_t k, T* out, int64_t n) {
  constexpr int64_t TILES_A_TASK = 4;
  const int64_t tile_bytes = groups * ((BITS == 4 ? 4 : 8) * 64 + 2 * TILE * 2);
  at::parallel_for(0, (tiles + TILES_A_TASK - 1) / TILES_A_TASK, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin * TILES_A_TASK; t < std::min(end * TILES_A_TASK, tiles); t += TILES_A_TASK) {
      for (int64_t m = 0; m < rows; m += ROWS_A_RUN) {
        for (int64_t i = t; i < std::min(t + TILES_A_TASK, tiles); ++i) {
          const uint8_t* tile = packed + i * tile_bytes;
          const int8_t* xm = xq + m * k;
          const float *dm = xd + m * groups, *sm = xs + m * groups;
          const int32_t* um = xsum + m * groups;
          T* o = out + m * n;
          switch (std::min(rows - m, ROWS_A_RUN)) {
#define ROWS_CASE(R)                                                                                  \
  case R:                                                                                             \
    if constexpr (R <= ROWS_A_RUN) tile_rows<BITS, R>(tile, groups, xm, dm, sm, um, k, o, n, i * TILE); \
    break;
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
  at::Tensor xsum = at::empty({rows, groups}, x.options().dtype(at::kInt));
  quantize_rows(x.data_ptr<T>(), rows, k, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>(),
                xsum.data_ptr<int32_t>());
  auto run = bits == 4 ? int8_dot<4, T> : int8_dot<8, T>;
  run(packed.data_ptr<uint8_t>(), tiles, groups, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<float>(),
      xsum.data_ptr<int32_t>(), rows, k, out.data_ptr<T>(), n);
}

#endif

}  // namespace

bool int8_dot_supported() {
#if defined(INT8_DOT)
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 or bfloat16, the packed weight [tiles, K / 32, 320 (4-bit) or 576 (8-bit) bytes], of which n
// columns are real. Returns x @ w.T [M, n] in x's dtype.
at::Tensor int8_dot_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(int8_dot_supported(), "int8_dot_linear needs AVX512-VNNI or AVX2 with FMA and F16C");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  (packed.size(2) == 320 || packed.size(2) == 576),
              "the weight must be packed by kernels/quant.py's pack_int8_dot");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1) * BLOCK, "x must be [M, 32 * groups]");
  TORCH_CHECK(n > (packed.size(0) - 1) * TILE && n <= packed.size(0) * TILE, "n must fall in the last tile");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
#if defined(INT8_DOT)
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
