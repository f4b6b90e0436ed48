// The row kernel's products (row_matmul.cc binds them to XLA; row_columns.cc instantiates them, one build unit per
// activation and weight type, so that a build runs on every core).
//
// With KB = 1 and no mins, out[g, m, n] is one chain of fused multiply-adds over k = 0, 1, ..., K - 1 (for
// `transposed`: kLanes chains over the residues of k mod kLanes, then added in a fixed tree), then times the scale. With
// blocks, each block's products are such a chain, and the blocks' chains times their scales (and the mins times the
// blocks' sums of x) are added in block order. Rows are taken up to eight at a time so that a weight tile is read
// once for them, but every row's chain is the same instructions on the same values: a row's result does not depend
// on M, on where the row sits, or on how columns are split across threads.
//
// Decode is a read of every weight once per step: a weight is streamed once per group of eight rows, as stored (one
// byte per int8 value, half a byte per 4-bit value), and converted to float32 in registers.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#define ROWS_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // x86-64-v3
#define ROWS_AVX2 1
#endif

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__SSE4_1__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace rows {

// A vector is the widest register of the build's ISA level (kernel_build.py names the level): 16 floats with
// AVX512, 8 with AVX2 + FMA, 4 elsewhere (SSE4, NEON, generic). Every order of sums below is stated in lanes, so a
// row's result does not depend on the pass within one build; builds for other levels may differ in the last bits.
#if defined(ROWS_AVX512)
constexpr int kLanes = 16;
constexpr const char* kIsa = "avx512";
#elif defined(ROWS_AVX2)
constexpr int kLanes = 8;
constexpr const char* kIsa = "avx2";
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
constexpr int kLanes = 4;
constexpr const char* kIsa = "neon-dotprod";
#elif defined(__ARM_NEON)
constexpr int kLanes = 4;
constexpr const char* kIsa = "neon";
#elif defined(__SSE4_1__)
constexpr int kLanes = 4;
constexpr const char* kIsa = "sse4";
#else
constexpr int kLanes = 4;
constexpr const char* kIsa = "generic";
#endif
constexpr int kSums = 8192;          // sums of one block (rows x columns) kept in L1
template <int R>
constexpr int kBlock = kSums / R / 32 * 32;  // columns per block (whole pairs of vectors)
constexpr int kRowsPerPass = 8;      // rows sharing a weight tile
constexpr int kPrefetchRows = 8;    // weight rows read ahead of the sums (the rows of a block lie N apart)
constexpr int kTransposedColumns = kLanes == 16 ? 8 : 4;  // weight rows per pass when transposed, up to 2 rows
// (fewer above): their sums and weights fill the registers (32 with AVX512, 16 with AVX2)
constexpr int kMaxHeadDim = 128;     // the decode attention's head dimension, at most

struct U4 {};  // the element type of a packed 4-bit weight (two values to a byte)

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Lanes __attribute__((vector_size(kLanes * sizeof(int32_t))));

template <typename T>
inline Lanes widen(const T* p) {  // kLanes consecutive integers, one a lane
  Lanes v;
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  return v;
}
inline Vec as_floats(Lanes bits) {
  Vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
// float16 bits (one a lane) -> float32, exact, in lane-wise integer steps the compiler keeps in vectors: normal
// values rebiased, subnormals as mantissa * 2^-24 (a normal float32: exact whatever the denormal mode), infinities
// and NaNs with their mantissa.
inline Vec halves_as_floats(Lanes h) {
  const Lanes sign = (h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  const Lanes normal = sign | ((exponent + 112) << 23) | (mantissa << 13);
  const Lanes special = sign | 0x7F800000 | (mantissa << 13);
  const Vec subnormal = __builtin_convertvector(mantissa, Vec) * (1.0f / 16777216.0f);
  Lanes small;
  std::memcpy(&small, &subnormal, sizeof small);
  small |= sign;
  const Lanes zero_exponent = exponent == 0, top_exponent = exponent == 31;  // -1 where true
  return as_floats((small & zero_exponent) | (special & top_exponent) | (normal & ~(zero_exponent | top_exponent)));
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(int8_t v) { return static_cast<float>(v); }
inline float half_to_float(uint16_t h) {  // IEEE float16 -> float32, exact
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float f = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (exponent == 31 ? 0x7F800000u : (exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// a * b + c with one rounding, spelled out: left to -ffp-contract, one instantiation of a loop was contracted
// differently from another, and a row's bits then depended on how many rows shared its pass. Without a fused
// multiply-add in hardware (x86-64-v2, generic): the product rounded, then the sum, the same two steps everywhere
// (the build turns contraction off there: kernel_build.py).
inline Vec fma(Vec a, Vec b, Vec c) {
#if defined(__AVX512F__)
  return (Vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(ROWS_AVX2)
  return (Vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_FMA)
  return (Vec)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#elif defined(__FMA__)
  return (Vec)_mm_fmadd_ps((__m128)a, (__m128)b, (__m128)c);
#else
  return a * b + c;
#endif
}

template <typename W>
inline Vec load(const W* p) {  // kLanes consecutive values as float32 (exact for each type)
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = to_float(p[i]);
  return v;
}

template <>
inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
#if defined(__AVX512F__)
template <>
inline Vec load(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (Vec)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
template <>
inline Vec load(const int8_t* p) {
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(ROWS_AVX2)
template <>
inline Vec load(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (Vec)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
template <>
inline Vec load(const int8_t* p) {
  return (Vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__SSE4_1__)
template <>
inline Vec load(const uint16_t* p) {
  __m128i wide = _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return (Vec)_mm_castsi128_ps(_mm_slli_epi32(wide, 16));
}
template <>
inline Vec load(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  return (Vec)_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four)));
}
#elif defined(__ARM_NEON)
template <>
inline Vec load(const uint16_t* p) {
  return (Vec)vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}
template <>
inline Vec load(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  const int8x8_t bytes = vreinterpret_s8_s32(vdup_n_s32(four));
  return (Vec)vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(bytes))));
}
#else  // generic: lane-wise integer vectors the compiler maps onto the target's registers
template <>
inline Vec load(const uint16_t* p) {
  return as_floats(widen(p) << 16);
}
template <>
inline Vec load(const int8_t* p) {
  return __builtin_convertvector(widen(p), Vec);
}
#endif

template <typename W>
inline Vec load_partial(const W* p, int count) {  // lanes past `count` are zero
  Vec v = {};
  for (int i = 0; i < count; ++i) v[i] = to_float(p[i]);
  return v;
}

inline Vec load_nibbles(const uint8_t* p) {  // kLanes consecutive 4-bit values from kLanes / 2 bytes (even: low)
#if defined(ROWS_AVX2) || defined(ROWS_AVX512)
  __m128i packed;
  if constexpr (kLanes == 16) {
    packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  } else {
    int32_t four;
    std::memcpy(&four, p, sizeof four);
    packed = _mm_cvtsi32_si128(four);
  }
  const __m128i bytes = _mm_cvtepu8_epi16(packed);  // one uint16 a byte
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi16(0x000F));
  const __m128i high = _mm_and_si128(_mm_slli_epi16(bytes, 4), _mm_set1_epi16(0x0F00));
  const __m128i nibbles = _mm_or_si128(low, high);  // one value a byte, in order
#if defined(__AVX512F__)
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles));
#else
  return (Vec)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles));
#endif
#else
  Lanes bytes;
  for (int i = 0; i < kLanes; ++i) bytes[i] = p[i / 2];
  Lanes shift;
  for (int i = 0; i < kLanes; ++i) shift[i] = 4 * (i % 2);
  return __builtin_convertvector((bytes >> shift) & 15, Vec);
#endif
}

inline Vec load_halves(const uint16_t* p) {  // kLanes consecutive float16 values as float32
#if defined(__AVX512F__)
  return (Vec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(ROWS_AVX2)
  return (Vec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__F16C__)
  return (Vec)_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif defined(__ARM_NEON)
  return (Vec)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
#else
  return halves_as_floats(widen(p));
#endif
}

// Element i of a weight stored as W (a flat index into its [K, N] or [N, K] matrix).
template <typename W>
struct Weights {
  const W* data;
  Vec load(int64_t i) const { return rows::load(data + i); }
  Vec load_partial(int64_t i, int count) const { return rows::load_partial(data + i, count); }
  const void* address(int64_t i) const { return data + i; }
  static constexpr int kVectorBytes = sizeof(W) * kLanes;
};

template <>
struct Weights<U4> {  // i even wherever a vector starts: N (or K when transposed) is even, vectors at kLanes k
  const uint8_t* data;
  Vec load(int64_t i) const { return load_nibbles(data + i / 2); }
  Vec load_partial(int64_t i, int count) const {
    Vec v = {};
    for (int c = 0; c < count; ++c) v[c] = static_cast<float>((data[(i + c) / 2] >> (4 * ((i + c) % 2))) & 15);
    return v;
  }
  const void* address(int64_t i) const { return data + i / 2; }
  static constexpr int kVectorBytes = kLanes / 2;
};

// Per-block scales and mins: [KB, N], or [N, KB] when transposed; float32 or float16; mins may be absent.
struct Blocks {
  const void* scales;
  const void* mins;  // nullptr: none
  bool half;
  int64_t KB;
  bool int8_rows = false;  // 4-bit and int8 weights in blocks: x's rows rounded to int8 per block first (row_int8.h)
  bool tiled = false;      // such a [K, N] weight, its values, scales and mins in tile order (row_tiles.h)
  float value(const void* p, int64_t i) const {
    if (!half) return static_cast<const float*>(p)[i];
#if defined(__F16C__)
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
#else
    return half_to_float(static_cast<const uint16_t*>(p)[i]);
#endif
  }
  Vec vector(const void* p, int64_t i, int count) const {  // count <= kLanes consecutive values, lanes past it zero
    if (count == kLanes)
      return half ? load_halves(static_cast<const uint16_t*>(p) + i) : rows::load(static_cast<const float*>(p) + i);
    Vec v = {};
    for (int c = 0; c < count; ++c) v[c] = value(p, i + c);
    return v;
  }
  Blocks at_matrix(int64_t g, int64_t N) const {  // the blocks of matrix g
    const int64_t offset = g * KB * N * (half ? 2 : 4);
    return {static_cast<const char*>(scales) + offset, mins ? static_cast<const char*>(mins) + offset : nullptr, half,
            KB, int8_rows, tiled};
  }
};

// 2 kLanes consecutive packed 4-bit values from kLanes bytes, split into the even-indexed ones and the odd-indexed
// ones.
inline void load_nibble_pairs(const uint8_t* p, Vec& even, Vec& odd) {
#if defined(__AVX512F__)
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  even = (Vec)_mm512_permutexvar_ps(bytes, levels);  // a lane's bits 0..3 pick the level: the low nibble
  odd = (Vec)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), levels);
#elif defined(ROWS_AVX2)
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  even = (Vec)_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
  odd = (Vec)_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
#elif defined(__SSE4_1__)
  int32_t four;
  std::memcpy(&four, p, sizeof four);
  const __m128i bytes = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(four));
  even = (Vec)_mm_cvtepi32_ps(_mm_and_si128(bytes, _mm_set1_epi32(15)));
  odd = (Vec)_mm_cvtepi32_ps(_mm_srli_epi32(bytes, 4));
#else
  const Lanes bytes = widen(p);
  even = __builtin_convertvector(bytes & 15, Vec);
  odd = __builtin_convertvector(bytes >> 4, Vec);
#endif
}

// count <= 2 kLanes consecutive per-block values (scales or mins) from i, split into even- and odd-indexed lanes.
inline void block_pairs(const Blocks& q, const void* p, int64_t i, int count, Vec& even, Vec& odd) {
  if (count == 2 * kLanes) {
#if defined(__AVX512F__)
    const __m512 first = (__m512)q.vector(p, i, kLanes), second = (__m512)q.vector(p, i + kLanes, kLanes);
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    even = (Vec)_mm512_permutex2var_ps(first, evens, second);
    odd = (Vec)_mm512_permutex2var_ps(first, _mm512_add_epi32(evens, _mm512_set1_epi32(1)), second);
    return;
#elif defined(ROWS_AVX2)
    const __m256 first = (__m256)q.vector(p, i, kLanes), second = (__m256)q.vector(p, i + kLanes, kLanes);
    // per 128-bit half: [f0 f2 s0 s2 | f4 f6 s4 s6]; then its 64-bit quarters in the order 0, 2, 1, 3
    even = (Vec)_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(first, second, 0x88)), 0xD8));
    odd = (Vec)_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(first, second, 0xDD)), 0xD8));
    return;
#elif defined(__SSE4_1__)
    const __m128 first = (__m128)q.vector(p, i, kLanes), second = (__m128)q.vector(p, i + kLanes, kLanes);
    even = (Vec)_mm_shuffle_ps(first, second, 0x88);
    odd = (Vec)_mm_shuffle_ps(first, second, 0xDD);
    return;
#else
    const Vec first = q.vector(p, i, kLanes), second = q.vector(p, i + kLanes, kLanes);
    even = __builtin_shuffle(first, second, Lanes{0, 2, 4, 6});
    odd = __builtin_shuffle(first, second, Lanes{1, 3, 5, 7});
    return;
#endif
  }
  even = Vec{};
  odd = Vec{};
  for (int c = 0; c < count; ++c) (c % 2 ? odd : even)[c / 2] = q.value(p, i + c);
}

template <int R>
constexpr int kPackedBlock = kBlock<R> / 2;  // columns per block: acc and part share L1

// Columns [n0, n0 + width) of a packed weight [K, N]: their 32-column pairs' nibbles, each block's scales and mins
// folded into the sums, and the sums written out.
struct PackedColumns {
  const uint8_t* first;  // the bytes of column n0 in weight row 0
  int64_t row_bytes, N, n0;
  int width, pairs, tail;  // tail: columns in the last pair

  PackedColumns(const uint8_t* w, int64_t N, int64_t n0, int width)
      : first(w + n0 / 2), row_bytes(N / 2), N(N), n0(n0), width(width), pairs((width + 2 * kLanes - 1) / (2 * kLanes)),
        tail(width - (pairs - 1) * 2 * kLanes) {}

  void load(int64_t k, int p, Vec& even, Vec& odd) const {  // pair p of weight row k
    if (p + 1 < pairs || tail == 2 * kLanes) return load_nibble_pairs(first + k * row_bytes + p * kLanes, even, odd);
    alignas(16) uint8_t bytes[kLanes] = {};
    std::memcpy(bytes, first + k * row_bytes + p * kLanes, (tail + 1) / 2);
    load_nibble_pairs(bytes, even, odd);
  }

  // acc[r][2p], acc[r][2p + 1] += block b's sums of pair p (part(r, 0) even columns, part(r, 1) odd) times its
  // scales, then its mins times the rows' sums of x over the block.
  template <int R, typename Part>
  void fold(const Blocks& q, int64_t b, int p, Part part, const float* sums,
            Vec (*acc)[kPackedBlock<R> / kLanes]) const {
    const int64_t column = n0 + p * 2 * kLanes;
    const int count = p + 1 < pairs ? 2 * kLanes : tail;
    Vec even_scale, odd_scale;
    block_pairs(q, q.scales, b * N + column, count, even_scale, odd_scale);
    for (int r = 0; r < R; ++r) {
      acc[r][2 * p] = fma(part(r, 0), even_scale, acc[r][2 * p]);
      acc[r][2 * p + 1] = fma(part(r, 1), odd_scale, acc[r][2 * p + 1]);
    }
    if (q.mins) {
      Vec even_min, odd_min;
      block_pairs(q, q.mins, b * N + column, count, even_min, odd_min);
      for (int r = 0; r < R; ++r) {
        const Vec sum = Vec{} + sums[r * q.KB + b];
        acc[r][2 * p] = fma(sum, even_min, acc[r][2 * p]);
        acc[r][2 * p + 1] = fma(sum, odd_min, acc[r][2 * p + 1]);
      }
    }
  }

  template <int R>
  void store(const Vec (*acc)[kPackedBlock<R> / kLanes], float* out) const {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < width; ++c)
        out[r * N + n0 + c] = acc[r][c / (2 * kLanes) * 2 + c % 2][c % (2 * kLanes) / 2];
  }
};

// blocked_column_block for packed 4-bit weights, streamed row by row as column_block streams its weights: 32
// columns at a time (16 bytes of a weight row), kept as their even and odd columns' sums ([2 p] and [2 p + 1] for
// the p-th 32 columns). A block's sums (`part`, in L1 beside `acc`) are folded into `acc` at the block's end.
template <int R, typename X>
void packed_column_block(const X* x, int64_t K, const uint8_t* w, int64_t N, int64_t n0, int width, const Blocks& q,
                         const float* sums, float* out) {
  const PackedColumns cols(w, N, n0, width);
  const int pairs = cols.pairs;
  const int64_t Kb = K / q.KB;
  alignas(64) Vec acc[R][kPackedBlock<R> / kLanes] = {};
  alignas(64) Vec part[R][kPackedBlock<R> / kLanes];
  for (int64_t b = 0; b < q.KB; ++b) {
    const int64_t k0 = b * Kb, k1 = k0 + Kb;
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 2 * pairs; ++j) part[r][j] = Vec{};
    int64_t k = k0;
    for (; k + 2 <= k1; k += 2) {
      const bool fetch = k + kPrefetchRows + 2 <= K;
      for (int p = 0; p < pairs; ++p) {
        if (fetch && p % 4 == 0)  // a cache line holds four pairs' bytes
          for (int i = 0; i < 2; ++i)
            __builtin_prefetch(cols.first + (k + kPrefetchRows + i) * cols.row_bytes + p * kLanes);
        Vec e0, o0, e1, o1;
        cols.load(k, p, e0, o0);
        cols.load(k + 1, p, e1, o1);
        for (int r = 0; r < R; ++r) {
          const Vec x0 = Vec{} + to_float(x[r * K + k]), x1 = Vec{} + to_float(x[r * K + k + 1]);
          part[r][2 * p] = fma(x1, e1, fma(x0, e0, part[r][2 * p]));
          part[r][2 * p + 1] = fma(x1, o1, fma(x0, o0, part[r][2 * p + 1]));
        }
      }
    }
    for (; k < k1; ++k)
      for (int p = 0; p < pairs; ++p) {
        Vec e0, o0;
        cols.load(k, p, e0, o0);
        for (int r = 0; r < R; ++r) {
          const Vec x0 = Vec{} + to_float(x[r * K + k]);
          part[r][2 * p] = fma(x0, e0, part[r][2 * p]);
          part[r][2 * p + 1] = fma(x0, o0, part[r][2 * p + 1]);
        }
      }
    for (int p = 0; p < pairs; ++p)
      cols.fold<R>(q, b, p, [&](int r, int odd) { return part[r][2 * p + odd]; }, sums, acc);
  }
  cols.store<R>(acc, out);
}

// x's value in every lane (a float's bits as they are: 0 + x would turn -0 into +0, and cost an add)
inline Vec splat(float v) {
#if defined(__AVX512F__)
  return (Vec)_mm512_set1_ps(v);
#elif defined(ROWS_AVX2)
  return (Vec)_mm256_set1_ps(v);
#else
  return Vec{} + v;
#endif
}
template <typename X>
inline Vec splat(X v) { return Vec{} + to_float(v); }

// packed_column_block where the multiply-adds and conversions (not the weight's bytes) set the pace: a block's sums
// stay in registers, P pairs at a time down the block's rows, instead of going through L1 at every row of the
// weight. Each column's chain is the same (k in order from zero, then the block's scale and min), so the bits are
// the same. With AVX512 and one or two rows the row-by-row stream is faster; with 8 lanes or fewer this is, from
// one row. With one or two rows, two pairs share a pass: 4 R chains of multiply-adds in flight (one pair's two
// chains wait on the add's latency at every row), the sums held apart from the fold (a lambda's reference to them
// kept them in memory). The lines a pass reads lie in rows N / 2 bytes apart, beyond the hardware prefetcher's
// reach: each pass fetches the same rows kPackedLinesAhead lines to its right (the next block's past the last line).
// 576 x 1536 at one row on an AVX2 EPYC, streamed from memory, one thread: 70-89 against 146-183 us a product.
constexpr int kRegisterBlockRows = kLanes == 16 ? 3 : 1;
constexpr int kPackedLinesAhead = 4;
template <int R, typename X>
void packed_register_block(const X* x, int64_t K, const uint8_t* w, int64_t N, int64_t n0, int width,
                           const Blocks& q, const float* sums, float* out) {
  constexpr int P = R <= 2 ? 2 : 1;  // pairs a pass
  constexpr int kPairsPerLine = 64 / kLanes;
  const PackedColumns cols(w, N, n0, width);
  const int64_t Kb = K / q.KB;
  const int lines = (cols.pairs + kPairsPerLine - 1) / kPairsPerLine;  // a block row's cache lines
  alignas(64) Vec acc[R][kPackedBlock<R> / kLanes] = {};
  // the block's pairs [p, p + n) down its Kb rows, then folded into acc (n: a std::integral_constant)
  auto pass = [&](int64_t b, int p, auto n) {
    constexpr int C = decltype(n)::value;
    const uint8_t* block = cols.first + b * Kb * cols.row_bytes;
    const int target = p / kPairsPerLine + kPackedLinesAhead;  // the line fetched, counted from this block's first
    const bool fetch = b + target / lines < q.KB;
    // the passes over a line share its rows' fetches: this one takes rows [first_row, first_row + Kb / share)
    constexpr int share = kPairsPerLine / C;
    const int64_t first_row = p % kPairsPerLine / C * (Kb / share);
    const uint8_t* ahead = block + (target / lines * Kb + first_row) * cols.row_bytes + target % lines * 64;
    if (b + 1 < q.KB) {  // the next block's scales and mins of these columns
      const int64_t next = ((b + 1) * N + n0 + p * 2 * kLanes) * (q.half ? 2 : 4);
      __builtin_prefetch(static_cast<const char*>(q.scales) + next);
      if (q.mins) __builtin_prefetch(static_cast<const char*>(q.mins) + next);
    }
    Vec even[R][C] = {}, odd[R][C] = {};
    for (int64_t k = 0; k < Kb; ++k) {
      if (fetch) __builtin_prefetch(ahead + k / share * cols.row_bytes);
      Vec e[C], o[C];
      if constexpr (C == 1)
        cols.load(b * Kb + k, p, e[0], o[0]);
      else  // whole pairs only
        for (int i = 0; i < C; ++i) load_nibble_pairs(block + k * cols.row_bytes + (p + i) * kLanes, e[i], o[i]);
      for (int r = 0; r < R; ++r) {
        const Vec xr = splat(x[r * K + b * Kb + k]);
        for (int i = 0; i < C; ++i) {
          even[r][i] = fma(xr, e[i], even[r][i]);
          odd[r][i] = fma(xr, o[i], odd[r][i]);
        }
      }
    }
    Vec done[R][2 * C];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < C; ++i) done[r][2 * i] = even[r][i], done[r][2 * i + 1] = odd[r][i];
    for (int i = 0; i < C; ++i)
      cols.fold<R>(q, b, p + i, [&](int r, int is_odd) { return done[r][2 * i + is_odd]; }, sums, acc);
  };
  const int whole = cols.tail == 2 * kLanes ? cols.pairs : cols.pairs - 1;  // pairs of 2 kLanes columns
  for (int64_t b = 0; b < q.KB; ++b) {
    int p = 0;
    for (; p + P <= whole; p += P) pass(b, p, std::integral_constant<int, P>{});
    for (; p < cols.pairs; ++p) pass(b, p, std::integral_constant<int, 1>{});
  }
  cols.store<R>(acc, out);
}

// Columns [n0, n0 + width) of R rows (x: the first row, its stride K) by w [K, N], width <= kBlock. The weight is
// streamed row by row (width contiguous values each), the sums kept in L1; four weight rows are added per pass over
// the sums, each element's chain still k = 0, 1, 2, ... in order.
template <int R, typename X, typename W>
void column_block(const X* x, int64_t K, Weights<W> w, int64_t N, int64_t n0, int width, const float* scales,
                  float* out) {
  const int vectors = (width + kLanes - 1) / kLanes;
  const int tail = width - (vectors - 1) * kLanes;  // values in the last vector
  alignas(64) Vec acc[R][kBlock<R> / kLanes] = {};
  auto weights = [&](int64_t k, int j) {
    const int64_t i = k * N + n0 + j * kLanes;
    return j + 1 < vectors || tail == kLanes ? w.load(i) : w.load_partial(i, tail);
  };
  constexpr int kVectorsPerLine = Weights<W>::kVectorBytes >= 64 ? 1 : 64 / Weights<W>::kVectorBytes;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const bool fetch = k + kPrefetchRows + 4 <= K;
    for (int j = 0; j < vectors; ++j) {
      if (fetch && j % kVectorsPerLine == 0)  // the rows kPrefetchRows ahead: runs of `width` values, N apart
        for (int i = 0; i < 4; ++i) __builtin_prefetch(w.address((k + kPrefetchRows + i) * N + n0 + j * kLanes));
      Vec w0 = weights(k, j), w1 = weights(k + 1, j), w2 = weights(k + 2, j), w3 = weights(k + 3, j);
      for (int r = 0; r < R; ++r) {
        const X* xr = x + r * K + k;
        Vec a = acc[r][j];
        a = fma(Vec{} + to_float(xr[0]), w0, a);
        a = fma(Vec{} + to_float(xr[1]), w1, a);
        a = fma(Vec{} + to_float(xr[2]), w2, a);
        a = fma(Vec{} + to_float(xr[3]), w3, a);
        acc[r][j] = a;
      }
    }
  }
  for (; k < K; ++k)
    for (int j = 0; j < vectors; ++j) {
      Vec wk = weights(k, j);
      for (int r = 0; r < R; ++r) acc[r][j] = fma(Vec{} + to_float(x[r * K + k]), wk, acc[r][j]);
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < width; ++c) out[r * N + n0 + c] = acc[r][c / kLanes][c % kLanes] * scales[n0 + c];
}

// column_block with KB blocks of Kb = K / KB weight rows: per 16 columns, a block's products are summed in a chain
// of their own (in registers), then times the block's scales, plus its mins times the block's sums of x (`sums`
// [R, KB]), added to the column's running sum. The next block's rows are fetched ahead, a cache line at a time.
template <int R, typename X, typename W>
void blocked_column_block(const X* x, int64_t K, Weights<W> w, int64_t N, int64_t n0, int width, const Blocks& q,
                          const float* sums, float* out) {
  const int vectors = (width + kLanes - 1) / kLanes;
  const int tail = width - (vectors - 1) * kLanes;
  const int64_t Kb = K / q.KB;
  alignas(64) Vec acc[R][kBlock<R> / kLanes] = {};
  constexpr int kVectorsPerLine = Weights<W>::kVectorBytes >= 64 ? 1 : 64 / Weights<W>::kVectorBytes;
  for (int64_t b = 0; b < q.KB; ++b) {
    const int64_t k0 = b * Kb, k1 = k0 + Kb;
    for (int j = 0; j < vectors; ++j) {
      const int64_t column = n0 + j * kLanes;
      const int count = j + 1 < vectors ? kLanes : tail;
      auto weights = [&](int64_t k) {
        return count == kLanes ? w.load(k * N + column) : w.load_partial(k * N + column, count);
      };
      if (k1 < K && j % kVectorsPerLine == 0)
        for (int64_t k = k1; k < k1 + Kb; ++k) __builtin_prefetch(w.address(k * N + column));
      Vec part[R] = {};
      int64_t k = k0;
      for (; k + 4 <= k1; k += 4) {
        Vec w0 = weights(k), w1 = weights(k + 1), w2 = weights(k + 2), w3 = weights(k + 3);
        for (int r = 0; r < R; ++r) {
          const X* xr = x + r * K + k;
          Vec a = part[r];
          a = fma(Vec{} + to_float(xr[0]), w0, a);
          a = fma(Vec{} + to_float(xr[1]), w1, a);
          a = fma(Vec{} + to_float(xr[2]), w2, a);
          a = fma(Vec{} + to_float(xr[3]), w3, a);
          part[r] = a;
        }
      }
      for (; k < k1; ++k) {
        Vec wk = weights(k);
        for (int r = 0; r < R; ++r) part[r] = fma(Vec{} + to_float(x[r * K + k]), wk, part[r]);
      }
      const Vec scale = q.vector(q.scales, b * N + column, count);
      for (int r = 0; r < R; ++r) acc[r][j] = fma(part[r], scale, acc[r][j]);
      if (q.mins) {
        const Vec min = q.vector(q.mins, b * N + column, count);
        for (int r = 0; r < R; ++r) acc[r][j] = fma(Vec{} + sums[r * q.KB + b], min, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < width; ++c) out[r * N + n0 + c] = acc[r][c / kLanes][c % kLanes];
}

inline float tree_sum(Vec v) {  // lanes added pairwise in a fixed tree: i + kLanes / 2, ..., then i + 1
#if defined(ROWS_AVX512)
  v = v + __builtin_shuffle(v, Lanes{8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15});
  v = v + __builtin_shuffle(v, Lanes{4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7});
  v = v + __builtin_shuffle(v, Lanes{2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3});
  v = v + __builtin_shuffle(v, Lanes{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
#elif defined(ROWS_AVX2)
  v = v + __builtin_shuffle(v, Lanes{4, 5, 6, 7, 4, 5, 6, 7});
  v = v + __builtin_shuffle(v, Lanes{2, 3, 2, 3, 2, 3, 2, 3});
  v = v + __builtin_shuffle(v, Lanes{1, 1, 1, 1, 1, 1, 1, 1});
#else
  v = v + __builtin_shuffle(v, Lanes{2, 3, 2, 3});
  v = v + __builtin_shuffle(v, Lanes{1, 1, 1, 1});
#endif
  return v[0];
}

// Weight rows [n0, n0 + C) of w [N, K] against R rows of x: out[r, n] = sum_k x[r, k] w[n, k].
template <int R, int C, typename X, typename W>
void row_block(const X* x, int64_t K, Weights<W> w, int64_t N, int64_t n0, const float* scales, float* out) {
  Vec acc[R][C] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = w.load((n0 + c) * K + k);
    for (int r = 0; r < R; ++r) {
      Vec xv = load(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = fma(xv, wv[c], acc[r][c]);
    }
  }
  if (k < K) {
    int count = static_cast<int>(K - k);
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = w.load_partial((n0 + c) * K + k, count);
    for (int r = 0; r < R; ++r) {
      Vec xv = load_partial(x + r * K + k, count);
      for (int c = 0; c < C; ++c) acc[r][c] = fma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * N + n0 + c] = tree_sum(acc[r][c]) * scales[n0 + c];
}

// row_block with KB blocks of Kb = K / KB (a multiple of 16) contracting elements: each block's 16 lane chains
// times the block's scale are added to running lane sums, added in the fixed tree at the end; the mins times the
// blocks' sums of x (`sums` [R, KB]) form a chain of their own, added last.
template <int R, int C, typename X, typename W>
void blocked_row_block(const X* x, int64_t K, Weights<W> w, int64_t N, int64_t n0, const Blocks& q,
                       const float* sums, float* out) {
  const int64_t Kb = K / q.KB;
  Vec acc[R][C] = {};
  float shift[R][C] = {};
  // the C rows two passes ahead lie in one run of bytes: a share of it fetched per block (rows of a few hundred
  // bytes are streams too short for the hardware's prefetcher)
  const char* ahead = static_cast<const char*>(w.address((n0 + 2 * C) * K));
  const int64_t share = (static_cast<const char*>(w.address((n0 + 3 * C) * K)) - ahead) / q.KB;
  for (int64_t b = 0; b < q.KB; ++b) {
    if (n0 + 3 * C <= N)
      for (int64_t i = b * share; i < (b + 1) * share; i += 64) __builtin_prefetch(ahead + i);
    Vec part[R][C] = {};
    for (int64_t k = b * Kb; k < (b + 1) * Kb; k += kLanes) {
      Vec wv[C];
      for (int c = 0; c < C; ++c) wv[c] = w.load((n0 + c) * K + k);
      for (int r = 0; r < R; ++r) {
        Vec xv = load(x + r * K + k);
        for (int c = 0; c < C; ++c) part[r][c] = fma(xv, wv[c], part[r][c]);
      }
    }
    for (int c = 0; c < C; ++c) {
      const Vec scale = Vec{} + q.value(q.scales, (n0 + c) * q.KB + b);
      for (int r = 0; r < R; ++r) acc[r][c] = fma(part[r][c], scale, acc[r][c]);
    }
    if (q.mins)
      for (int c = 0; c < C; ++c) {
        const float min = q.value(q.mins, (n0 + c) * q.KB + b);
        for (int r = 0; r < R; ++r) shift[r][c] = __builtin_fmaf(sums[r * q.KB + b], min, shift[r][c]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * N + n0 + c] = tree_sum(acc[r][c]) + shift[r][c];
}

template <int R, typename X, typename W>
void rows_by_block(const X* x, int64_t K, Weights<W> w, int64_t N, bool transposed, int64_t n0, int64_t n1,
                   const float* scales, float* out) {
  if (!transposed) {
    for (int64_t n = n0; n < n1; n += kBlock<R>)
      column_block<R>(x, K, w, N, n, static_cast<int>(std::min<int64_t>(kBlock<R>, n1 - n)), scales, out);
    return;
  }
  // R * C sums and C weight vectors in registers
  constexpr int C = R <= 2 ? kTransposedColumns : R <= 4 ? kTransposedColumns / 2 : kTransposedColumns / 4;
  int64_t n = n0;
  for (; n + C <= n1; n += C) row_block<R, C>(x, K, w, N, n, scales, out);
  for (; n < n1; ++n) row_block<R, 1>(x, K, w, N, n, scales, out);
}

template <int R, typename X, typename W>
void blocked_rows_by_block(const X* x, int64_t K, Weights<W> w, int64_t N, bool transposed, int64_t n0, int64_t n1,
                           const Blocks& q, const float* sums, float* out) {
  if (!transposed) {
    constexpr int64_t block = std::is_same_v<W, U4> ? kPackedBlock<R> : kBlock<R>;
    for (int64_t n = n0; n < n1; n += block) {
      const int width = static_cast<int>(std::min<int64_t>(block, n1 - n));
      if constexpr (std::is_same_v<W, U4> && R >= kRegisterBlockRows)
        packed_register_block<R>(x, K, w.data, N, n, width, q, sums, out);
      else if constexpr (std::is_same_v<W, U4>)
        packed_column_block<R>(x, K, w.data, N, n, width, q, sums, out);
      else
        blocked_column_block<R>(x, K, w, N, n, width, q, sums, out);
    }
    return;
  }
  // 2 * R * C sums and C weight vectors in registers: with 16 of them (AVX2, SSE), at most 4 rows at once, so the
  // rows past the fourth take the same columns in a second pass (their bytes still in L1)
  constexpr int R0 = kLanes == 16 || R <= 4 ? R : 4, R1 = R - R0;
  constexpr int C = R0 == 1 ? kTransposedColumns : R0 == 2 ? kTransposedColumns / 2 : R0 <= 4 && kLanes == 16 ? 2 : 1;
  auto pass = [&](auto columns, int64_t n) {
    blocked_row_block<R0, decltype(columns)::value>(x, K, w, N, n, q, sums, out);
    if constexpr (R1 > 0)
      blocked_row_block<R1, decltype(columns)::value>(x + R0 * K, K, w, N, n, q, sums + R0 * q.KB, out + R0 * N);
  };
  int64_t n = n0;
  for (; n + C <= n1; n += C) pass(std::integral_constant<int, C>{}, n);
  for (; n < n1; ++n) pass(std::integral_constant<int, 1>{}, n);
}

// body(rows, m) for each group of `rows` (a std::integral_constant, up to kRowsPerPass) rows starting at row m.
template <typename Body>
void by_row_groups(int64_t M, Body body) {
  int64_t m = 0;
  for (; m + kRowsPerPass <= M; m += kRowsPerPass) body(std::integral_constant<int, kRowsPerPass>{}, m);
  switch (M - m) {
    case 7: body(std::integral_constant<int, 7>{}, m); break;
    case 6: body(std::integral_constant<int, 6>{}, m); break;
    case 5: body(std::integral_constant<int, 5>{}, m); break;
    case 4: body(std::integral_constant<int, 4>{}, m); break;
    case 3: body(std::integral_constant<int, 3>{}, m); break;
    case 2: body(std::integral_constant<int, 2>{}, m); break;
    case 1: body(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

template <typename X, typename W>
void blocked_columns(const X* x, int64_t M, int64_t K, Weights<W> w, int64_t N, bool transposed, int64_t n0,
                     int64_t n1, const Blocks& q, float* out);

}  // namespace rows

#include "row_int8.h"

namespace rows {

// Every row of one matrix (x [M, K], w, out [M, N]) for output columns [n0, n1).
template <typename X, typename W>
void columns(const X* x, int64_t M, int64_t K, Weights<W> w, int64_t N, bool transposed, int64_t n0, int64_t n1,
             const Blocks& q, float* out) {
  if constexpr (!std::is_same_v<W, U4>) {  // 4-bit values always come with blocks and mins (RowMatmul checks)
    if (q.KB == 1 && !q.mins && !q.half) {  // one float32 scale per column, applied to each finished sum
      const float* scales = static_cast<const float*>(q.scales);
      by_row_groups(M, [&](auto rows, int64_t m) {
        rows_by_block<decltype(rows)::value>(x + m * K, K, w, N, transposed, n0, n1, scales, out + m * N);
      });
      return;
    }
  }
  if constexpr (std::is_same_v<W, U4>) {
    if (q.tiled) return int8_tiles_columns<4>(x, M, K, w.data, N, n0, n1, q, out);
    if (q.int8_rows) return int8_rows_columns<4>(x, M, K, w.data, N, n0, n1, q, out);  // not transposed (checked)
  }
  if constexpr (std::is_same_v<W, int8_t>) {
    if (q.int8_rows && transposed) return int8_rows_transposed(x, M, K, w.data, N, n0, n1, q, out);
    if (q.tiled) return int8_tiles_columns<8>(x, M, K, reinterpret_cast<const uint8_t*>(w.data), N, n0, n1, q, out);
    if (q.int8_rows)
      return int8_rows_columns<8>(x, M, K, reinterpret_cast<const uint8_t*>(w.data), N, n0, n1, q, out);
  }
  if constexpr (std::is_same_v<W, int8_t> || std::is_same_v<W, U4>)  // blocks: int8 and 4-bit weights only
    blocked_columns(x, M, K, w, N, transposed, n0, n1, q, out);
}

template <typename X, typename W>
void blocked_columns(const X* x, int64_t M, int64_t K, Weights<W> w, int64_t N, bool transposed, int64_t n0,
                     int64_t n1, const Blocks& q, float* out) {
  const int64_t Kb = K / q.KB;
  std::vector<float> sums(q.mins ? M * q.KB : 0);  // [M, KB]: each row's sum of x over each block, k in order
  for (int64_t i = 0; i < static_cast<int64_t>(sums.size()); ++i) {
    const X* xr = x + (i / q.KB) * K + (i % q.KB) * Kb;
    float sum = 0.0f;
    for (int64_t k = 0; k < Kb; ++k) sum += to_float(xr[k]);
    sums[i] = sum;
  }
  by_row_groups(M, [&](auto rows, int64_t m) {
    blocked_rows_by_block<decltype(rows)::value>(x + m * K, K, w, N, transposed, n0, n1, q,
                                                 sums.data() + m * q.KB, out + m * N);
  });
}


// columns<X, W>'s declaration, for its explicit instantiations (row_columns.cc, a build unit per pair) and the
// binding's `extern template`s (row_matmul.cc): X float or uint16_t (bfloat16); W float, uint16_t, int8_t or U4.
#define ROWS_COLUMNS(X, W) \
  void columns<X, W>(const X*, int64_t, int64_t, Weights<W>, int64_t, bool, int64_t, int64_t, const Blocks&, float*)

}  // namespace rows
