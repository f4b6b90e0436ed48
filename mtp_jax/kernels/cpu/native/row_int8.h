// 4-bit weights by activations rounded to int8 (llama.cpp's Q4_1 x Q8_1): the row kernel's product for weights
// whose `Blocks` ask for it (`int8_rows`), included by row_kernels.h.
//
// Each row of x is rounded per block of Kb = K / KB contracting elements: d = max |x| / 127, q = x / d rounded to
// the nearest integer (ties to even), s = d * sum(q). A block's products are then integers, summed exactly:
//   isum[n] = sum_k value[k, n] * q[k]                       (value 0..15, q -127..127)
//   out[n] += isum[n] * (scale[b, n] * d) + min[b, n] * s    (blocks in order, one fused multiply-add chain)
// Integer sums do not depend on their order, and the float chain per column is the same whatever M, so a row's
// result is the same bits whatever else shares the pass. With AVX512-VNNI and VBMI the sums are vpdpbusd over
// four contracting elements a lane (64 products an instruction, against 16 for float32 fused multiply-adds); with
// AVX2 they are vpmaddubsw then vpmaddwd (as llama.cpp's Q4 x Q8 kernels do), with NEON's dotprod sdot; any
// other CPU sums them one by one.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace rows {

typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

template <int R>
constexpr int kInt8Strips = 768 / (2 * kLanes) / R > 0 ? 768 / (2 * kLanes) / R : 1;  // strips of 2 kLanes columns
// a pass keeps in L1 (R x 12 KB at most)

// x's rows rounded per block: q [M, K], d and s [M, KB].
struct RoundedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

template <typename X>
RoundedRows round_rows(const X* x, int64_t M, int64_t K, int64_t KB) {
  const int64_t Kb = K / KB;
  RoundedRows rounded{std::vector<int8_t>(M * K), std::vector<float>(M * KB), std::vector<float>(M * KB)};
  for (int64_t i = 0; i < M * KB; ++i) {
    const int64_t m = i / KB, k0 = (i % KB) * Kb;
    float largest = 0.0f;
    for (int64_t k = k0; k < k0 + Kb; ++k) largest = std::max(largest, std::fabs(to_float(x[m * K + k])));
    const float d = largest / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int64_t k = k0; k < k0 + Kb; ++k) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(to_float(x[m * K + k]) * inverse));
      rounded.q[m * K + k] = static_cast<int8_t>(v);
      sum += v;
    }
    rounded.d[i] = d;
    rounded.s[i] = d * static_cast<float>(sum);
  }
  return rounded;
}

// sums[r][s][0] (even columns) and [1] (odd) += weight rows k .. k + 3 of strip s (16 bytes a row from `first`)
// times row r's q[k .. k + 3]; lane i of strip s holds columns 2 i and 2 i + 1.
template <int R>
inline void add_quad(const uint8_t* first, int64_t row_bytes, const int8_t* const* q, int strips,
                     Ints (*sums)[kInt8Strips<R>][2]) {
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  alignas(64) static constexpr uint8_t kOrder[64] = {  // byte 4 i + j of the result: byte i of row j
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54,
      7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59, 12, 28, 44, 60, 13, 29, 45, 61,
      14, 30, 46, 62, 15, 31, 47, 63};
  const __m512i order = _mm512_load_si512(kOrder), nibble = _mm512_set1_epi8(0x0F);
  __m512i x[R];
  for (int r = 0; r < R; ++r) {
    int32_t four;
    std::memcpy(&four, q[r], sizeof four);
    x[r] = _mm512_set1_epi32(four);
  }
  for (int s = 0; s < strips; ++s) {
    const uint8_t* p = first + s * kLanes;
    if (s % 4 == 0)  // a cache line holds four strips of a row: the rows eight ahead
      for (int i = 0; i < 4; ++i) __builtin_prefetch(p + (8 + i) * row_bytes);
    __m512i bytes = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    bytes = _mm512_inserti32x4(bytes, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + row_bytes)), 1);
    bytes = _mm512_inserti32x4(bytes, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * row_bytes)), 2);
    bytes = _mm512_inserti32x4(bytes, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * row_bytes)), 3);
    const __m512i quads = _mm512_permutexvar_epi8(order, bytes);
    const __m512i even = _mm512_and_si512(quads, nibble);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(quads, 4), nibble);
    for (int r = 0; r < R; ++r) {
      sums[r][s][0] = (Ints)_mm512_dpbusd_epi32((__m512i)sums[r][s][0], even, x[r]);
      sums[r][s][1] = (Ints)_mm512_dpbusd_epi32((__m512i)sums[r][s][1], odd, x[r]);
    }
  }
#elif defined(ROWS_AVX2)
  // vpmaddubsw multiplies the weight's unsigned bytes by x's signed ones and adds neighbours (at most 2 x 15 x 127:
  // no saturation); vpmaddwd by ones adds those pairs: each lane's four products, as integers
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i x[R];
  for (int r = 0; r < R; ++r) {
    int32_t four;
    std::memcpy(&four, q[r], sizeof four);
    x[r] = _mm256_set1_epi32(four);
  }
  auto row = [&](const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); };
  for (int s = 0; s < strips; ++s) {
    const uint8_t* p = first + s * kLanes;
    if (s % 8 == 0)  // a cache line holds eight strips of a row: the rows eight ahead
      for (int i = 0; i < 4; ++i) __builtin_prefetch(p + (8 + i) * row_bytes);
    const __m128i rows01 = _mm_unpacklo_epi8(row(p), row(p + row_bytes));  // byte i of row 0, of row 1, ...
    const __m128i rows23 = _mm_unpacklo_epi8(row(p + 2 * row_bytes), row(p + 3 * row_bytes));
    const __m256i quads = _mm256_set_m128i(_mm_unpackhi_epi16(rows01, rows23), _mm_unpacklo_epi16(rows01, rows23));
    const __m256i even = _mm256_and_si256(quads, nibble);  // lane i: byte i of rows 0..3, low nibbles
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(quads, 4), nibble);
    for (int r = 0; r < R; ++r) {
      const __m256i e = _mm256_madd_epi16(_mm256_maddubs_epi16(even, x[r]), ones);
      const __m256i o = _mm256_madd_epi16(_mm256_maddubs_epi16(odd, x[r]), ones);
      sums[r][s][0] = (Ints)_mm256_add_epi32((__m256i)sums[r][s][0], e);
      sums[r][s][1] = (Ints)_mm256_add_epi32((__m256i)sums[r][s][1], o);
    }
  }
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
  // sdot: each lane's four signed products summed (the nibbles 0..15 read as signed bytes)
  int32x4_t x[R];
  for (int r = 0; r < R; ++r) {
    int32_t four;
    std::memcpy(&four, q[r], sizeof four);
    x[r] = vdupq_n_s32(four);
  }
  auto row = [&](const uint8_t* p) {
    uint32_t four;
    std::memcpy(&four, p, sizeof four);
    return vreinterpret_u8_u32(vdup_n_u32(four));
  };
  const uint8x16_t nibble = vdupq_n_u8(0x0F);
  for (int s = 0; s < strips; ++s) {
    const uint8_t* p = first + s * kLanes;
    const uint8x8x2_t rows01 = vzip_u8(row(p), row(p + row_bytes));  // byte i of row 0, of row 1, ...
    const uint8x8x2_t rows23 = vzip_u8(row(p + 2 * row_bytes), row(p + 3 * row_bytes));
    const uint16x4x2_t quads = vzip_u16(vreinterpret_u16_u8(rows01.val[0]), vreinterpret_u16_u8(rows23.val[0]));
    const uint8x16_t bytes = vreinterpretq_u8_u16(vcombine_u16(quads.val[0], quads.val[1]));
    const int8x16_t even = vreinterpretq_s8_u8(vandq_u8(bytes, nibble));  // lane i: byte i of rows 0..3, low
    const int8x16_t odd = vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4));
    for (int r = 0; r < R; ++r) {
      const int8x16_t xr = vreinterpretq_s8_s32(x[r]);
      sums[r][s][0] = (Ints)vdotq_s32((int32x4_t)sums[r][s][0], even, xr);
      sums[r][s][1] = (Ints)vdotq_s32((int32x4_t)sums[r][s][1], odd, xr);
    }
  }
#else
  for (int s = 0; s < strips; ++s)
    for (int j = 0; j < 4; ++j) {
      const uint8_t* p = first + j * row_bytes + s * kLanes;
      for (int i = 0; i < kLanes; ++i)
        for (int r = 0; r < R; ++r) {
          sums[r][s][0][i] += static_cast<int32_t>(p[i] & 15) * q[r][j];
          sums[r][s][1][i] += static_cast<int32_t>(p[i] >> 4) * q[r][j];
        }
    }
#endif
}

// Columns [n0, n0 + 32 strips) of R rounded rows by a packed 4-bit weight [K, N] (N % 32 == 0).
template <int R>
void int8_rows_strips(const RoundedRows& x, int64_t m0, int64_t K, const uint8_t* w, int64_t N, int64_t n0,
                      int strips, const Blocks& q, float* out) {
  const int64_t Kb = K / q.KB, row_bytes = N / 2;
  alignas(64) Vec acc[R][kInt8Strips<R>][2] = {};
  alignas(64) Ints sums[R][kInt8Strips<R>][2];
  for (int64_t b = 0; b < q.KB; ++b) {
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < strips; ++s) sums[r][s][0] = sums[r][s][1] = Ints{};
    for (int64_t k = b * Kb; k < (b + 1) * Kb; k += 4) {
      const int8_t* rows_q[R];
      for (int r = 0; r < R; ++r) rows_q[r] = x.q.data() + (m0 + r) * K + k;
      add_quad<R>(w + k * row_bytes + n0 / 2, row_bytes, rows_q, strips, sums);
    }
    for (int s = 0; s < strips; ++s) {
      Vec scale[2], min[2] = {};
      block_pairs(q, q.scales, b * N + n0 + s * 2 * kLanes, 2 * kLanes, scale[0], scale[1]);
      if (q.mins) block_pairs(q, q.mins, b * N + n0 + s * 2 * kLanes, 2 * kLanes, min[0], min[1]);
      for (int r = 0; r < R; ++r) {
        const Vec d = Vec{} + x.d[(m0 + r) * q.KB + b], shift = Vec{} + x.s[(m0 + r) * q.KB + b];
        for (int half = 0; half < 2; ++half) {
          const Vec sum = __builtin_convertvector(sums[r][s][half], Vec);
          acc[r][s][half] = fma(sum, scale[half] * d, fma(min[half], shift, acc[r][s][half]));
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < strips; ++s)
      for (int i = 0; i < kLanes; ++i) {
        out[r * N + n0 + s * 2 * kLanes + 2 * i] = acc[r][s][0][i];
        out[r * N + n0 + s * 2 * kLanes + 2 * i + 1] = acc[r][s][1][i];
      }
}

// Every row of one matrix (x [M, K]) by a packed 4-bit weight [K, N], output columns [n0, n1) (multiples of 32).
template <typename X>
void int8_rows_columns(const X* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t n0, int64_t n1,
                       const Blocks& q, float* out) {
  const RoundedRows rounded = round_rows(x, M, K, q.KB);
  by_row_groups(M, [&](auto rows, int64_t m) {
    constexpr int R = decltype(rows)::value;
    for (int64_t n = n0; n < n1; n += kInt8Strips<R> * 2 * kLanes) {
      const int strips = static_cast<int>(std::min<int64_t>(kInt8Strips<R>, (n1 - n) / (2 * kLanes)));
      int8_rows_strips<R>(rounded, m, K, w, N, n, strips, q, out + m * N);
    }
  });
}

}  // namespace rows
