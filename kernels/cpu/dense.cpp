// Dense products for a decode step's few rows: out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]), float32
// accumulation, out in x's dtype, read from oneDNN's packed weight itself, so one copy of the weight serves every
// batch size (kernels/dense.py checks at load that the packing is the layout below).
// bfloat16, oneDNN's AB16b32a2b (on CPUs with AMX) or AB16b64a2b (without):
//   tiles of T = 32 or 64 output columns, one after another; a tile holds the pairs of inputs in order, pair p
//   being the T columns' (w[n, 2p], w[n, 2p + 1]): 4 T bytes, T / 16 registers. K is padded with zeros to a
//   multiple of 32 and the columns to a multiple of T.
//   A row's pair of inputs is broadcast and AVX512-BF16's dot product (vdpbf16ps) adds both products into each
//   column's float32 lane: no horizontal sums, and each tile is streamed once for all of the rows.
// float32: tiles of 64 output columns, one after another; a tile holds each input's 64 weights in order (256
//   bytes, four registers). K is padded with zeros to a multiple of 16 and the columns to a multiple of 64.
//   A row's input is broadcast and multiplied into the four registers (FMA).
// The weight is one sequential stream per thread, prefetched into L2 well ahead, which is what brings it to the
// memory's rate (oneDNN's own kernel reads it at about two thirds of that at these row counts: docs/benchmarks.md).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t K_BLOCK = 32;            // a bfloat16 weight's K is padded to a multiple of this
constexpr int64_t PREFETCH_BYTES = 16384;  // ahead of the pair being read, into L2
// Rows one pass over a bfloat16 tile computes (more rows read it again from cache), by its registers a pair: 8 rows x
// 2 accumulators, or 6 rows x 4 (with the tile's 4 registers, 28 of 32).
constexpr int64_t rows_a_pass(int regs) { return regs == 2 ? 8 : 6; }
constexpr int64_t TILE_F32 = 64;           // output columns a float32 tile
constexpr int64_t ROWS_A_PASS_F32 = 6;     // 6 rows x 4 accumulators and the tile's 4 registers: 28 of 32

#if defined(__AVX512F__) && defined(__AVX512BF16__)

inline __m512bh broadcast_pair(const at::BFloat16* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// ROWS rows against one tile of REGS registers a pair (pairs pairs of inputs). Each column's sum is one chain over
// the pairs in order, for every ROWS: a row's output does not depend on how many rows share the call (batch
// invariance), and the tile's REGS independent chains keep the dot products' latency off a row's critical path.
template <int ROWS, int REGS>
inline void tile_rows(const at::BFloat16* tile, int64_t pairs, const at::BFloat16* x, int64_t x_stride,
                      const float* bias, at::BFloat16* out, int64_t n, int64_t col) {
  constexpr int64_t PAIR_BYTES = 64 * REGS;
  __m512 acc[ROWS][REGS];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < REGS; ++j) acc[r][j] = _mm512_setzero_ps();
  const char* bytes = reinterpret_cast<const char*>(tile);
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[REGS];
    for (int j = 0; j < REGS; ++j) {
      _mm_prefetch(bytes + p * PAIR_BYTES + PREFETCH_BYTES + 64 * j, _MM_HINT_T1);
      w[j] = (__m512bh)_mm512_loadu_si512(bytes + p * PAIR_BYTES + 64 * j);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xp = broadcast_pair(x + r * x_stride + 2 * p);
      for (int j = 0; j < REGS; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xp, w[j]);
    }
  }
  // Register j's lanes are columns col + 16 j .. col + 16 j + 15.
  for (int j = 0; j < REGS; ++j) {
    const int64_t c = col + 16 * j;
    if (c >= n) break;
    const __mmask16 mask = c + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - c)) - 1);
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + c);
    for (int r = 0; r < ROWS; ++r)
      _mm256_mask_storeu_epi16(out + r * n + c, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b)));
  }
}

template <int REGS>
void dense(const at::BFloat16* w, int64_t tiles, int64_t k_padded, const at::BFloat16* x, int64_t rows,
           int64_t x_stride, int64_t pairs, const float* bias, at::BFloat16* out, int64_t n) {
  constexpr int64_t tile_cols = 16 * REGS, rows_per_pass = rows_a_pass(REGS);
  const int64_t tile_elems = tile_cols * k_padded;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const at::BFloat16* tile = w + t * tile_elems;
      for (int64_t m = 0; m < rows; m += rows_per_pass) {
        const at::BFloat16* xm = x + m * x_stride;
        at::BFloat16* o = out + m * n;
        switch (std::min(rows - m, rows_per_pass)) {
#define ROWS_CASE(R) \
  case R: tile_rows<R, REGS>(tile, pairs, xm, x_stride, bias, o, n, t * tile_cols); break;
          ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
#undef ROWS_CASE
          case 7: if constexpr (REGS == 2) tile_rows<7, REGS>(tile, pairs, xm, x_stride, bias, o, n, t * tile_cols); break;
          case 8: if constexpr (REGS == 2) tile_rows<8, REGS>(tile, pairs, xm, x_stride, bias, o, n, t * tile_cols); break;
        }
      }
    }
  });
}

#endif

#if defined(__AVX512F__)

// ROWS rows against one float32 tile (64 columns: four registers a k) over k = 0 .. k - 1.
template <int ROWS>
inline void tile_rows_f32(const float* tile, int64_t k, const float* x, int64_t x_stride, const float* bias,
                          float* out, int64_t n, int64_t col) {
  __m512 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const char* bytes = reinterpret_cast<const char*>(tile);
  for (int64_t i = 0; i < k; ++i) {
    const char* row = bytes + i * 256;
    for (int j = 0; j < 4; ++j) _mm_prefetch(row + PREFETCH_BYTES + 64 * j, _MM_HINT_T1);
    __m512 w[4];
    for (int j = 0; j < 4; ++j) w[j] = _mm512_loadu_ps(row + 64 * j);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * x_stride + i]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xb, w[j], acc[r][j]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t c = col + 16 * j;
    if (c >= n) break;
    const __mmask16 mask = c + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - c)) - 1);
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + c);
    for (int r = 0; r < ROWS; ++r) _mm512_mask_storeu_ps(out + r * n + c, mask, _mm512_add_ps(acc[r][j], b));
  }
}

void dense_f32(const float* w, int64_t tiles, int64_t k_padded, const float* x, int64_t rows, int64_t x_stride,
               int64_t k, const float* bias, float* out, int64_t n) {
  const int64_t tile_elems = TILE_F32 * k_padded;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* tile = w + t * tile_elems;
      for (int64_t m = 0; m < rows; m += ROWS_A_PASS_F32) {
        const float* xm = x + m * x_stride;
        float* o = out + m * n;
        switch (std::min(rows - m, ROWS_A_PASS_F32)) {
#define ROWS_CASE(R) \
  case R: tile_rows_f32<R>(tile, k, xm, x_stride, bias, o, n, t * TILE_F32); break;
          ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
#undef ROWS_CASE
        }
      }
    }
  });
}

#elif defined(__AVX2__) && defined(__FMA__)

// float32 on AVX2, the same packed tiles of 64 columns (eight registers an input). Each column is summed as oneDNN's
// own AVX2 kernel sums it, so that a step's rows give the same bits on either kernel and the engine can hand many
// rows to oneDNN without breaking batch invariance (engine/models/quantization.py checks it at load): a chain of FMAs over each
// 1,024 inputs in order, the chains added in order, then the bias. A tile is read in slices of KC inputs (16 KB) that
// stay in L1 while every row passes over them; accumulators wait in a buffer between slices.
constexpr int64_t CHAIN_F32_AVX2 = 1024;  // inputs a chain, as oneDNN's AVX2 float32 kernel splits K
constexpr int64_t KC = 64;                // inputs a slice of a tile
constexpr int64_t ROWS_A_BLOCK = 64;      // rows a tile's buffers hold; more rows read the tile again
constexpr int64_t PREFETCH_L1_ROWS = 8;
constexpr int64_t PREFETCH_UPFRONT_ROWS = 12;

// ROWS rows against REGS registers (8 REGS columns) of one slice: acc[r][j] continues the chain in buf (or starts
// it), one FMA an input. Each pass prefetches its share of the next slice, pf_lines cache lines from pf: the passes
// over a slice then keep the memory busy while they compute. With few rows a pass's share is large and is spread
// over its inputs. From PREFETCH_UPFRONT_ROWS rows a share is a few lines, issued into L2 before the loop, which
// then holds nothing but loads and FMAs: 1.2 to 1.45x at 16 to 128 rows on an EPYC Zen 3, where the prefetch's
// bookkeeping an input took the core's issue slots from the FMAs. into_l1: spread prefetches go into L1, not L2, in
// calls of PREFETCH_L1_ROWS rows or more, whose passes over a slice last long enough for them to arrive (1.04x at 8
// rows on an EPYC Zen 3); fewer rows gain nothing or lose a little.
template <int ROWS, int REGS, bool UPFRONT>
inline void slice_rows_f32(const float* w, int64_t inputs, const float* x, int64_t x_stride, float* buf, bool start,
                           const char* pf, int64_t pf_lines, bool into_l1) {
  __m256 acc[ROWS][REGS];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < REGS; ++j) acc[r][j] = start ? _mm256_setzero_ps() : _mm256_loadu_ps(buf + r * 64 + 8 * j);
  if constexpr (UPFRONT)
    for (int64_t l = 0; l < pf_lines; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
  const int64_t lines_an_input = UPFRONT ? 0 : (pf_lines + inputs - 1) / inputs;
  for (int64_t i = 0; i < inputs; ++i) {
    const float* row = w + i * TILE_F32;
    if constexpr (!UPFRONT)
      for (int64_t l = i * lines_an_input; l < std::min(pf_lines, (i + 1) * lines_an_input); ++l)
        into_l1 ? _mm_prefetch(pf + 64 * l, _MM_HINT_T0) : _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
    __m256 held[REGS];  // a quarter tile's two registers, loaded once an input; a half tile's four leave no room
    if constexpr (REGS <= 2)
      for (int j = 0; j < REGS; ++j) held[j] = _mm256_loadu_ps(row + 8 * j);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * x_stride + i);
      for (int j = 0; j < REGS; ++j)
        acc[r][j] = _mm256_fmadd_ps(xb, REGS <= 2 ? held[j] : _mm256_loadu_ps(row + 8 * j), acc[r][j]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < REGS; ++j) _mm256_storeu_ps(buf + r * 64 + 8 * j, acc[r][j]);
}

// rows (at most ROWS_A_BLOCK) against one tile: one row in all eight registers; more in passes of six rows over a
// quarter of the tile (twelve accumulators, its two registers held), those left three at a time over half of it
// (twelve accumulators, the weights read from L1 by the FMAs).
template <bool UPFRONT>
void tile_block_f32(const float* tile, int64_t k, const float* x, int64_t rows, int64_t x_stride, const float* bias,
                    float* out, int64_t n, int64_t col) {
  alignas(32) float chain[ROWS_A_BLOCK * TILE_F32];
  alignas(32) float total[ROWS_A_BLOCK * TILE_F32];
  for (int64_t c0 = 0; c0 < k; c0 += CHAIN_F32_AVX2) {
    const int64_t c1 = std::min(k, c0 + CHAIN_F32_AVX2);
    for (int64_t s = c0; s < c1; s += KC) {
      const float* w = tile + s * TILE_F32;
      const int64_t inputs = std::min(KC, c1 - s);
      const bool start = s == c0;
      const char* next = reinterpret_cast<const char*>(w) + PREFETCH_BYTES;
      const int64_t lines = inputs * TILE_F32 * 4 / 64;  // the next slice's, as long as this one
      if (rows == 1) {
        slice_rows_f32<1, 8, false>(w, inputs, x + s, x_stride, chain, start, next, lines, false);
        continue;
      }
      const bool into_l1 = rows >= PREFETCH_L1_ROWS;
      const int64_t six = rows / 6 * 6;
      const int64_t passes = six / 6 * 4 + 2 * ((rows - six + 2) / 3);
      const auto line = [&](int64_t pass) { return lines * pass / passes; };  // where pass's share starts
      int64_t p = 0;
      for (int64_t m = 0; m < six; m += 6)
        for (int q = 0; q < 4; ++q, ++p)
          slice_rows_f32<6, 2, UPFRONT>(w + 16 * q, inputs, x + m * x_stride + s, x_stride,
                                        chain + m * TILE_F32 + 16 * q, start, next + 64 * line(p),
                                        line(p + 1) - line(p), into_l1);
      for (int64_t m = six; m < rows; m += 3) {
        for (int h = 0; h < 2; ++h, ++p) {
          const float* xm = x + m * x_stride + s;
          float* b = chain + m * TILE_F32 + 32 * h;
          switch (std::min<int64_t>(rows - m, 3)) {
#define ROWS_CASE(R) \
  case R: slice_rows_f32<R, 4, UPFRONT>(w + 32 * h, inputs, xm, x_stride, b, start, next + 64 * line(p), line(p + 1) - line(p), into_l1); break;
            ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3)
#undef ROWS_CASE
          }
        }
      }
    }
    for (int64_t e = 0; e < rows * TILE_F32; e += 8) {
      const __m256 v = _mm256_load_ps(chain + e);
      _mm256_store_ps(total + e, c0 == 0 ? v : _mm256_add_ps(_mm256_load_ps(total + e), v));
    }
  }
  const int64_t cols = std::min(TILE_F32, n - col);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j)
      out[r * n + col + j] = bias == nullptr ? total[r * TILE_F32 + j] : total[r * TILE_F32 + j] + bias[col + j];
}

void dense_f32(const float* w, int64_t tiles, int64_t k_padded, const float* x, int64_t rows, int64_t x_stride,
               int64_t k, const float* bias, float* out, int64_t n) {
  const int64_t tile_elems = TILE_F32 * k_padded;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m = 0; m < rows; m += ROWS_A_BLOCK) {
        const int64_t block = std::min(rows - m, ROWS_A_BLOCK);
        (block >= PREFETCH_UPFRONT_ROWS ? tile_block_f32<true> : tile_block_f32<false>)(
            w + t * tile_elems, k, x + m * x_stride, block, x_stride, bias, out + m * n, n, t * TILE_F32);
      }
  });
}

// Group-quantized codes in float32 (kernels/quant.py's format: w[n, k] = q[n, k] * scale + zero, a float32 multiply
// then an add, per group of inputs), for a decode step's few rows: the rows are bound by reading the weight, and the
// codes are an eighth (4-bit) or a quarter (8-bit) of the float32 weight's bytes. The codes come in dense_f32's tiles
// of 64 columns: each input's 64 int8 codes in order, or, for codes in [0, 15], 32 bytes whose low nibbles are columns
// 0-31 and high nibbles columns 32-63. The scales and zeros are [tiles, groups, 64], float32 or (where every one is a
// float16 value, as GGUF's 4-bit blocks hold them) float16, converted exactly. Each weight is formed in registers as
// dequantize() forms it, and each column summed as dense_f32 sums it (chains of CHAIN_F32_AVX2 inputs in order, added
// in order), so a row's output has dense_linear's bits on the dequantized weight.

// Columns 8 p .. 8 p + 7 and 32 + 8 p .. 32 + 8 p + 7 (p < 4) of one input's codes as int32. 4-bit codes: bytes
// 8 p .. 8 p + 7 widened, whose low nibbles are the first eight columns and high nibbles the second.
template <bool NIBBLES>
inline void codes_of(const uint8_t* q, int p, __m256i& lo, __m256i& hi) {
  if constexpr (NIBBLES) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * p)));
    lo = _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F));
    hi = _mm256_srli_epi32(bytes, 4);
  } else {
    lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * p)));
    hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 32 + 8 * p)));
  }
}

// A group's 64 scales or zeros as float32: where they are (float32), or converted into buf (float16).
template <typename S>
inline const float* group_floats(const S* src, float* buf) {
  if constexpr (std::is_same_v<S, float>) {
    return src;
  } else {
    for (int j = 0; j < 8; ++j)
      _mm256_store_ps(buf + 8 * j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8 * j))));
    return buf;
  }
}

// A weight from its code: EXACT, every code times its scale is exact in float32 (kernels/dense.py's products_exact),
// so one FMA gives the bits of dequantize()'s rounded sum; otherwise the product is rounded before the add, as there.
template <bool EXACT>
inline __m256 weight_of(__m256i code, __m256 scale, __m256 zero) {
  const __m256 c = _mm256_cvtepi32_ps(code);
  if constexpr (EXACT) {
    return _mm256_fmadd_ps(c, scale, zero);
  } else {
    __m256 w = _mm256_mul_ps(c, scale);
    __asm__("" : "+x"(w));  // rounded before the add: no FMA contraction here
    return _mm256_add_ps(w, zero);
  }
}

constexpr int64_t CODES_BLOCK = 128;  // inputs whose codes (4 or 8 KB) stay in L1 while the passes read them
constexpr int CODES_ROWS = 4;         // rows a pass at most

// ROWS rows against one tile of codes. Over a block of inputs, passes each take PAIRS of the tile's pairs of registers
// of columns (p and p + 4, which one load of 4-bit codes holds), so that each weight formed serves every row and a
// pass has at least eight independent chains of FMAs (one row: the whole tile in one pass). A column's chain runs
// over the inputs in order, waiting in chains[] between blocks.
template <bool NIBBLES, bool EXACT, int ROWS, typename S>
void codes_tile_rows(const uint8_t* codes, const S* scales, const S* zeros, int64_t k, int64_t group_size,
                     const float* x, int64_t x_stride, float* out, int64_t n, int64_t col) {
  constexpr int64_t BYTES = NIBBLES ? TILE_F32 / 2 : TILE_F32;  // an input's codes
  constexpr int PAIRS = ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1;
  alignas(32) float s_buf[TILE_F32], z_buf[TILE_F32];
  alignas(32) float chains[ROWS][TILE_F32], totals[ROWS][TILE_F32];
  for (int64_t c0 = 0; c0 < k; c0 += CHAIN_F32_AVX2) {
    const int64_t c1 = std::min(k, c0 + CHAIN_F32_AVX2);
    for (int64_t b0 = c0; b0 < c1;) {  // a block: within one group and one chain
      const int64_t g = b0 / group_size, b1 = std::min({c1, (g + 1) * group_size, b0 + CODES_BLOCK});
      const float* s = group_floats(scales + g * TILE_F32, s_buf);
      const float* z = group_floats(zeros + g * TILE_F32, z_buf);
      const char* next = reinterpret_cast<const char*>(codes + b1 * BYTES);  // the next block's codes, into L2
      for (int64_t line = 0; line < (b1 - b0) * BYTES; line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
      for (int p0 = 0; p0 < 4; p0 += PAIRS) {
        __m256 acc[ROWS][PAIRS][2];
        #pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r)
          #pragma GCC unroll 8
          for (int p = 0; p < PAIRS; ++p)
            #pragma GCC unroll 8
            for (int h = 0; h < 2; ++h)
              acc[r][p][h] = b0 == c0 ? _mm256_setzero_ps() : _mm256_load_ps(&chains[r][32 * h + 8 * (p0 + p)]);
        __m256 sv[PAIRS][2], zv[PAIRS][2];  // in registers for one pair; read from L1 for more
        #pragma GCC unroll 8
        for (int p = 0; p < PAIRS; ++p)
          #pragma GCC unroll 8
          for (int h = 0; h < 2; ++h) {
            sv[p][h] = _mm256_loadu_ps(s + 32 * h + 8 * (p0 + p));
            zv[p][h] = _mm256_loadu_ps(z + 32 * h + 8 * (p0 + p));
          }
        for (int64_t i = b0; i < b1; ++i) {
          const uint8_t* q = codes + i * BYTES;
          #pragma GCC unroll 8
          for (int p = 0; p < PAIRS; ++p) {
            __m256i c_lo, c_hi;
            codes_of<NIBBLES>(q, p0 + p, c_lo, c_hi);
            const __m256 w_lo = weight_of<EXACT>(c_lo, sv[p][0], zv[p][0]);
            const __m256 w_hi = weight_of<EXACT>(c_hi, sv[p][1], zv[p][1]);
            #pragma GCC unroll 8
            for (int r = 0; r < ROWS; ++r) {
              const __m256 xb = _mm256_broadcast_ss(x + r * x_stride + i);
              acc[r][p][0] = _mm256_fmadd_ps(xb, w_lo, acc[r][p][0]);
              acc[r][p][1] = _mm256_fmadd_ps(xb, w_hi, acc[r][p][1]);
            }
          }
        }
        #pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r)
          #pragma GCC unroll 8
          for (int p = 0; p < PAIRS; ++p)
            #pragma GCC unroll 8
            for (int h = 0; h < 2; ++h) _mm256_store_ps(&chains[r][32 * h + 8 * (p0 + p)], acc[r][p][h]);
      }
      b0 = b1;
    }
    #pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < TILE_F32; j += 8) {
        const __m256 chain = _mm256_load_ps(&chains[r][j]);
        _mm256_store_ps(&totals[r][j], c0 == 0 ? chain : _mm256_add_ps(_mm256_load_ps(&totals[r][j]), chain));
      }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) std::copy_n(totals[r], std::min(TILE_F32, n - col), out + r * n + col);
}

template <bool NIBBLES, bool EXACT, typename S>
void codes_f32(const uint8_t* codes, const S* scales, const S* zeros, int64_t tiles, int64_t k, int64_t group_size,
               const float* x, int64_t rows, int64_t x_stride, float* out, int64_t n) {
  const int64_t groups = k / group_size, tile_bytes = k * (NIBBLES ? TILE_F32 / 2 : TILE_F32);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m = 0; m < rows; m += CODES_ROWS) {
        const uint8_t* c = codes + t * tile_bytes;
        const S *s = scales + t * groups * TILE_F32, *z = zeros + t * groups * TILE_F32;
        const float* xm = x + m * x_stride;
        float* o = out + m * n;
        switch (std::min<int64_t>(rows - m, CODES_ROWS)) {
#define ROWS_CASE(R) \
  case R: codes_tile_rows<NIBBLES, EXACT, R>(c, s, z, k, group_size, xm, x_stride, o, n, t * TILE_F32); break;
          ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
#undef ROWS_CASE
        }
      }
  });
}

#endif

}  // namespace

bool dense_supported(at::ScalarType dtype) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

namespace {

at::Tensor bias_as_float(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [n]");
  return bias->to(at::kFloat).contiguous();
}

at::Tensor dense_linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  (packed.size(2) == 32 || packed.size(2) == 64) && packed.size(3) == 2 &&
                  (2 * packed.size(1)) % K_BLOCK == 0,
              "the weight must be oneDNN's packed AB16b32a2b or AB16b64a2b layout [tiles, K / 2, 32 or 64, 2] "
              "(kernels/dense.py)");
  const int64_t k = x.size(1), k_padded = 2 * packed.size(1), tiles = packed.size(0), tile_cols = packed.size(2);
  TORCH_CHECK(k <= k_padded && k_padded < k + K_BLOCK, "x's K does not match the packed weight");
  TORCH_CHECK(n > (tiles - 1) * tile_cols && n <= tiles * tile_cols, "n must fall in the last tile");
  // An odd K reads one input past the row: pad it with a zero (the weight's padding is zero too).
  const at::Tensor xc = k % 2 == 0 ? x.contiguous() : at::constant_pad_nd(x, {0, 1}).contiguous();
  const at::Tensor bias_f = bias_as_float(bias, n);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  (tile_cols == 32 ? dense<2> : dense<4>)(packed.data_ptr<at::BFloat16>(), tiles, k_padded,
                                          xc.data_ptr<at::BFloat16>(), x.size(0), xc.size(1), (k + 1) / 2,
                                          bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
                                          out.data_ptr<at::BFloat16>(), n);
#endif
  return out;
}

at::Tensor dense_linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(2) == TILE_F32 && packed.size(1) % 16 == 0,
              "the weight must be oneDNN's packed float32 layout [tiles, K padded to 16, 64] (kernels/dense.py)");
  const int64_t k = x.size(1), k_padded = packed.size(1), tiles = packed.size(0);
  TORCH_CHECK(k <= k_padded && k_padded < k + 16, "x's K does not match the packed weight");
  TORCH_CHECK(n > (tiles - 1) * TILE_F32 && n <= tiles * TILE_F32, "n must fall in the last tile");
  const at::Tensor xc = x.contiguous();
  const at::Tensor bias_f = bias_as_float(bias, n);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  dense_f32(packed.data_ptr<float>(), tiles, k_padded, xc.data_ptr<float>(), x.size(0), xc.size(1), k,
            bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, out.data_ptr<float>(), n);
#endif
  return out;
}

}  // namespace

// x [M, K] bfloat16 or float32; packed is oneDNN's packed weight of that dtype as kernels/dense.py's packed_view
// sees it (the layouts above), of which n columns are real; bias [n] or None. Returns x @ w.T + bias [M, n] in
// x's dtype.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be bfloat16 or float32 [M, K]");
  TORCH_CHECK(dense_supported(x.scalar_type()),
              "dense_linear needs AVX-512 or AVX2 with FMA for float32, AVX512-BF16 for bfloat16");
  return x.scalar_type() == at::kFloat ? dense_linear_f32(x, packed, n, bias) : dense_linear_bf16(x, packed, n, bias);
}

bool dense_codes_supported() {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return true;
#else
  return false;
#endif
}

// x [M, K] float32; codes [tiles, K, 64] int8 or, for 4-bit codes, [tiles, K, 32] uint8 (two a byte); scales and zeros
// [tiles, K / group_size, 64], both float32 or both float16 (kernels/dense.py's pack_codes), of which n columns are
// real; products_exact: every code times its scale is exact in float32 (pack_codes says). Returns x @ w.T [M, n] for
// w the codes' dequantized weight, without bias.
at::Tensor dense_codes_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& zeros, bool products_exact, int64_t group_size, int64_t n) {
  TORCH_CHECK(dense_codes_supported(),
              "dense_codes_linear needs AVX2 with FMA and F16C (and runs only where AVX-512 is absent)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "x must be float32 [M, K], K > 0");
  const bool nibbles = codes.scalar_type() == at::kByte;
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.size(1) == x.size(1) &&
                  ((codes.scalar_type() == at::kChar && codes.size(2) == TILE_F32) ||
                   (nibbles && codes.size(2) == TILE_F32 / 2)),
              "codes must be int8 [tiles, K, 64] or uint8 [tiles, K, 32] (kernels/dense.py's pack_codes)");
  TORCH_CHECK(group_size > 0 && x.size(1) % group_size == 0, "K must be a multiple of group_size");
  const bool halves = scales.scalar_type() == at::kHalf;
  for (const auto* t : {&scales, &zeros})
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) &&
                    t->scalar_type() == scales.scalar_type() && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == codes.size(0) && t->size(1) == x.size(1) / group_size && t->size(2) == TILE_F32,
                "scales and zeros must be both float32 or both float16 [tiles, K / group_size, 64]");
  TORCH_CHECK(n > (codes.size(0) - 1) * TILE_F32 && n <= codes.size(0) * TILE_F32, "n must fall in the last tile");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const auto* q = static_cast<const uint8_t*>(codes.data_ptr());
  // The layout's three choices as template arguments: 4-bit codes, exact products, float16 scales.
  const auto run = [&](auto nib, auto exact, const auto* s, const auto* z) {
    codes_f32<decltype(nib)::value, decltype(exact)::value>(q, s, z, codes.size(0), x.size(1), group_size,
                                                            xc.data_ptr<float>(), x.size(0), xc.size(1),
                                                            out.data_ptr<float>(), n);
  };
  const auto with_scales = [&](auto nib, auto exact) {
    if (halves)
      run(nib, exact, static_cast<const uint16_t*>(scales.data_ptr()), static_cast<const uint16_t*>(zeros.data_ptr()));
    else
      run(nib, exact, scales.data_ptr<float>(), zeros.data_ptr<float>());
  };
  const auto with_exact = [&](auto nib) {
    products_exact ? with_scales(nib, std::true_type{}) : with_scales(nib, std::false_type{});
  };
  nibbles ? with_exact(std::true_type{}) : with_exact(std::false_type{});
#endif
  return out;
}

TORCH_LIBRARY(llmmesh_dense, m) {
  m.def("dense_supported", &dense_supported);
  m.def("dense_linear", &dense_linear);
  m.def("dense_codes_supported", &dense_codes_supported);
  m.def("dense_codes_linear", &dense_codes_linear);
}
