// Weights in blocks by activations rounded to int8 (llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0): the row kernel's
// product for weights whose `Blocks` ask for it (`int8_rows`), included by row_kernels.h. Three forms:
//   4-bit values [K, N] packed two to a byte along N, with a scale and a min per block and column (Q4_1);
//   8-bit values [K, N] or [N, K] (an embedding read as a tied lm_head) with a scale per block and column (Q8_0).
//
// Each row of x is rounded per block of Kb = K / KB contracting elements: d = max |x| / 127, q = x / d rounded to
// the nearest integer (ties to even), s = d * sum(q). A block's products are then integers, summed exactly:
//   isum[n] = sum_k value[k, n] * q[k]                         (value 0..15 or -127..127, q -127..127)
//   out[n] += isum[n] * (scale[b, n] * d) + min[b, n] * s      (blocks in order, one fused multiply-add chain)
// For [N, K] the integer sums are those of each vector's lanes (four products a lane), each lane's times its block's
// scale and d added to its own float sum, the lanes added in a fixed tree at the end. Integer sums do not depend on
// their order, and a row's float chain is the same whatever M, so a row's result is the same bits whatever else
// shares the pass.
//
// Instructions: with AVX512-VNNI a lane's four products are one vpdpbusd (64 products an instruction; an 8-bit
// weight is offset by 128 to make it unsigned, and 128 * the lane's sum of q taken off after); with AVX2 vpmaddubsw
// then vpmaddwd (as llama.cpp's kernels do; 8-bit weights as |w| times q with w's sign; 4-bit ones' 16-bit pairs
// summed down a block first, and four strips' bytes gathered by one set of loads); with NEON's dotprod sdot;
// any other CPU sums them one by one. A pass keeps the sums of up to eight rows and a few column strips in
// registers down a block's rows, so each weight byte is read and unpacked once for eight rows.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace rows {

typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

// x's rows rounded per block: q [M, K]; d, s, and qsum (the integer sum of q) [M, KB]; with `quads`, [M, K / 4] each
// four consecutive q summed (the [N, K] form's lanes), else empty. (128 times a sum of q is what 8-bit weights offset
// by 128 add to a sum of products.)
struct RoundedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> qsum, quads;
};

template <typename X>
RoundedRows round_rows(const X* x, int64_t M, int64_t K, int64_t KB, bool quads = false) {
  const int64_t Kb = K / KB;
  RoundedRows rounded{std::vector<int8_t>(M * K), std::vector<float>(M * KB), std::vector<float>(M * KB),
                      std::vector<int32_t>(M * KB), std::vector<int32_t>(quads ? M * K / 4 : 0)};
  for (int64_t i = 0; i < M * KB; ++i) {
    const int64_t m = i / KB, k0 = (i % KB) * Kb;
    float largest = 0.0f;
    for (int64_t k = k0; k < k0 + Kb; ++k) largest = std::max(largest, std::fabs(to_float(x[m * K + k])));
    const float d = largest / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int64_t k = k0; k < k0 + Kb; ++k) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(to_float(x[m * K + k]) * inverse));
      rounded.q[m * K + k] = static_cast<int8_t>(v);
      if (quads) rounded.quads[(m * K + k) / 4] += v;
      sum += v;
    }
    rounded.d[i] = d;
    rounded.s[i] = d * static_cast<float>(sum);
    rounded.qsum[i] = sum;
  }
  return rounded;
}

// The ISA's pieces. A "quad" is, per lane, four bytes: weight rows k .. k + 3 of one column (the lane's), or four
// consecutive q of a row (the same four in every lane: `broadcast_q`).
//   gather_rows(p, row_bytes): kLanes bytes from each of four weight rows at p, row_bytes apart: lane i the four
//     rows' byte i (split_nibbles: its 4-bit values, the low in `even`, the high in `odd`; offset_q: its 8-bit
//     ones offset by kOffset)
//   wide_quads(p, row_bytes, quads): kWideStrips strips' quads from one gather, lane i of quads[j] the rows' byte
//     wide_byte(j, i); wide_pairs / wide_values: a block's scales for those lanes' columns
//   dot_small(sum, w, x): sum + each lane's four products, w's bytes 0..15 (widen_small: such sums as 32-bit lanes)
//   dot_signed(sum, w, x): the same for signed bytes; with kOffset, w's bytes were offset by 128 (offset_q does it)
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
constexpr const char* kIntegerDot = "vpdpbusd";  // how a lane's four products are summed
typedef __m512i Quad;
constexpr int kOffset = 128;
inline Quad broadcast_q(const int8_t* q) {
  int32_t four;
  std::memcpy(&four, q, sizeof four);
  return _mm512_set1_epi32(four);
}
inline __m512i gather_rows(const uint8_t* p, int64_t row_bytes) {  // 16 bytes of rows 0..3 -> byte 4 i + j: row j's
  alignas(64) static constexpr uint8_t kOrder[64] = {  // byte i
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54,
      7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59, 12, 28, 44, 60, 13, 29, 45, 61,
      14, 30, 46, 62, 15, 31, 47, 63};
  __m512i bytes = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  bytes = _mm512_inserti32x4(bytes, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + row_bytes)), 1);
  bytes = _mm512_inserti32x4(bytes, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * row_bytes)), 2);
  bytes = _mm512_inserti32x4(bytes, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * row_bytes)), 3);
  return _mm512_permutexvar_epi8(_mm512_load_si512(kOrder), bytes);
}
inline void split_nibbles(Quad bytes, Quad& even, Quad& odd) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  even = _mm512_and_si512(bytes, nibble);
  odd = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
}
inline Quad load_q(const uint8_t* p) { return _mm512_loadu_si512(p); }  // kLanes quads of one weight row ([N, K])
inline Quad offset_q(Quad w) { return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline Ints dot_small(Ints sum, Quad w, Quad x) { return (Ints)_mm512_dpbusd_epi32((__m512i)sum, w, x); }
inline Ints dot_signed(Ints sum, Quad w, Quad x) { return (Ints)_mm512_dpbusd_epi32((__m512i)sum, w, x); }
inline Ints widen_small(Ints sums) { return sums; }
#elif defined(ROWS_AVX2)
constexpr const char* kIntegerDot = "vpmaddubsw";
typedef __m256i Quad;
constexpr int kOffset = 0;
inline Quad broadcast_q(const int8_t* q) {
  int32_t four;
  std::memcpy(&four, q, sizeof four);
  return _mm256_set1_epi32(four);
}
inline __m256i gather_rows(const uint8_t* p, int64_t row_bytes) {  // 8 bytes of rows 0..3 -> byte 4 i + j: row j's
  auto row = [&](int j) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + j * row_bytes)); };  // byte i
  const __m128i rows01 = _mm_unpacklo_epi8(row(0), row(1)), rows23 = _mm_unpacklo_epi8(row(2), row(3));
  return _mm256_set_m128i(_mm_unpackhi_epi16(rows01, rows23), _mm_unpacklo_epi16(rows01, rows23));
}
inline void split_nibbles(Quad bytes, Quad& even, Quad& odd) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  even = _mm256_and_si256(bytes, nibble);
  odd = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
}
inline Quad load_q(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Quad offset_q(Quad w) { return w; }
// vpmaddubsw's pairs of products stay inside 16 bits: at most 2 x 15 x 127, and 2 x 128 x 127 for |w| below.
// 4-bit weights' pairs are summed in 16 bits down a block (8 quads of at most 32 rows: below 8 x 3,810 = 30,480,
// `int8_rows_reads`) and widened to 32 once, at the block's fold (widen_small).
inline Ints dot_small(Ints pairs, Quad w, Quad x) {
  return (Ints)_mm256_add_epi16((__m256i)pairs, _mm256_maddubs_epi16(w, x));
}
inline Ints widen_small(Ints pairs) { return (Ints)_mm256_madd_epi16((__m256i)pairs, _mm256_set1_epi16(1)); }
// Four strips' quads from one gather (32 bytes of each of four weight rows, unpacked within 128-bit halves): lane i
// of wide quad j holds byte wide_byte(j, i) of the 32, so each quad's columns are two runs of consecutive ones.
constexpr int kWideStrips = 4;
constexpr int wide_byte(int j, int i) { return 16 * (i / 4) + 4 * j + i % 4; }
inline void wide_quads(const uint8_t* p, int64_t row_bytes, Quad quads[kWideStrips]) {
  auto row = [&](int j) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j * row_bytes)); };
  const __m256i r0 = row(0), r1 = row(1), r2 = row(2), r3 = row(3);
  const __m256i low01 = _mm256_unpacklo_epi8(r0, r1), high01 = _mm256_unpackhi_epi8(r0, r1);
  const __m256i low23 = _mm256_unpacklo_epi8(r2, r3), high23 = _mm256_unpackhi_epi8(r2, r3);
  quads[0] = _mm256_unpacklo_epi16(low01, low23);
  quads[1] = _mm256_unpackhi_epi16(low01, low23);
  quads[2] = _mm256_unpacklo_epi16(high01, high23);
  quads[3] = _mm256_unpackhi_epi16(high01, high23);
}
// A block's scales (or mins) of wide quad j's columns, from p's values at i + its columns (i: the first column of
// the four strips). 4-bit: columns 2 wide_byte(j, i) (even) and + 1 (odd): runs [8 j, 8 j + 8) and 32 on.
inline void wide_pairs(const Blocks& q, const void* p, int64_t i, int j, Vec& even, Vec& odd) {
  const __m256 first = (__m256)q.vector(p, i + 8 * j, kLanes), second = (__m256)q.vector(p, i + 32 + 8 * j, kLanes);
  const __m256 low = _mm256_permute2f128_ps(first, second, 0x20), high = _mm256_permute2f128_ps(first, second, 0x31);
  even = (Vec)_mm256_shuffle_ps(low, high, 0x88);
  odd = (Vec)_mm256_shuffle_ps(low, high, 0xDD);
}
// 8-bit: columns wide_byte(j, i): runs [4 j, 4 j + 4) and 16 on.
inline Vec wide_values(const Blocks& q, const void* p, int64_t i, int j) {
  if (!q.half) {
    const float* f = static_cast<const float*>(p) + i + 4 * j;
    return (Vec)_mm256_set_m128(_mm_loadu_ps(f + 16), _mm_loadu_ps(f));
  }
  const uint16_t* h = static_cast<const uint16_t*>(p) + i + 4 * j;
  return (Vec)_mm256_cvtph_ps(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h)),
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h + 16))));
}
inline Ints dot_signed(Ints sum, Quad w, Quad x) {
  const __m256i product = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return (Ints)_mm256_add_epi32((__m256i)sum, _mm256_madd_epi16(product, _mm256_set1_epi16(1)));
}
#else  // NEON (sdot with dotprod), and one by one elsewhere: lanes of four bytes in plain arrays
struct Quad {
  int8_t b[4 * kLanes];
};
#if defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
constexpr const char* kIntegerDot = "sdot";
#else
constexpr const char* kIntegerDot = "none";  // one product at a time
#endif
constexpr int kOffset = 0;
inline Quad broadcast_q(const int8_t* q) {
  Quad v;
  for (int i = 0; i < kLanes; ++i) std::memcpy(v.b + 4 * i, q, 4);
  return v;
}
inline Quad gather_rows(const uint8_t* p, int64_t row_bytes) {  // kLanes bytes of rows 0..3
  Quad v;
  for (int i = 0; i < kLanes; ++i)
    for (int j = 0; j < 4; ++j) v.b[4 * i + j] = static_cast<int8_t>(p[j * row_bytes + i]);
  return v;
}
inline void split_nibbles(const Quad& bytes, Quad& even, Quad& odd) {
  for (int i = 0; i < 4 * kLanes; ++i) {
    even.b[i] = static_cast<int8_t>(static_cast<uint8_t>(bytes.b[i]) & 15);
    odd.b[i] = static_cast<int8_t>(static_cast<uint8_t>(bytes.b[i]) >> 4);
  }
}
inline Quad load_q(const uint8_t* p) {
  Quad v;
  std::memcpy(v.b, p, sizeof v.b);
  return v;
}
inline Quad offset_q(Quad w) { return w; }
inline Ints dot_signed(Ints sum, const Quad& w, const Quad& x) {
#if defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
  return (Ints)vdotq_s32((int32x4_t)sum, vld1q_s8(w.b), vld1q_s8(x.b));
#else
  for (int i = 0; i < kLanes; ++i)
    for (int j = 0; j < 4; ++j) sum[i] += static_cast<int32_t>(w.b[4 * i + j]) * x.b[4 * i + j];
  return sum;
#endif
}
inline Ints dot_small(Ints sum, const Quad& w, const Quad& x) { return dot_signed(sum, w, x); }
inline Ints widen_small(Ints sums) { return sums; }
#endif

#if !defined(ROWS_AVX2)  // a unit of strips is one strip, its lanes in column order
constexpr int kWideStrips = 1;
constexpr int wide_byte(int, int i) { return i; }
inline void wide_quads(const uint8_t* p, int64_t row_bytes, Quad quads[1]) { quads[0] = gather_rows(p, row_bytes); }
inline void wide_pairs(const Blocks& q, const void* p, int64_t i, int, Vec& even, Vec& odd) {
  block_pairs(q, p, i, 2 * kLanes, even, odd);
}
inline Vec wide_values(const Blocks& q, const void* p, int64_t i, int) { return q.vector(p, i, kLanes); }
#endif

template <int Bits>
constexpr int kStripColumns = Bits == 4 ? 2 * kLanes : kLanes;  // columns a strip: its lanes (each lane 2 for 4-bit)

// Whether the int8-rows product reads a weight of this form and shape ([K, N], or [N, K] when `transposed`, KB
// blocks along K of a multiple of 4 elements): 4-bit [K, N] with N a multiple of 2 kLanes; 8-bit [K, N] with N a
// multiple of kLanes; 8-bit [N, K] with K a multiple of 4 kLanes and a block's lanes (Kb / 4) a multiple of kLanes
// or half of it.
inline bool int8_rows_reads(bool packed, bool int8, bool transposed, int64_t K, int64_t N, int64_t KB) {
  if (KB < 1 || K % KB != 0 || (K / KB) % 4 != 0) return false;
  if (packed) return !transposed && N % (2 * kLanes) == 0 && K / KB <= 32;  // (16-bit pair sums: dot_small)
  if (!int8) return false;
  if (!transposed) return N % kLanes == 0;
  const int64_t lanes = K / KB / 4;
  return K % (4 * kLanes) == 0 && (lanes % kLanes == 0 || 2 * lanes == kLanes);
}
constexpr int kStripsPerRow = kLanes == 16 ? 4 : 2;  // strips a one-row pass keeps in registers (32 of them with
// AVX512, 16 with AVX2)
template <int Bits, int R>
constexpr int kPassStrips = std::max(1, kStripsPerRow * (Bits == 4 ? 1 : 2) / R);

// The three steps every pass takes for one strip, its sums and float sums given as sum(r, h) and acc(r, h) (each a
// Ints& / Vec&; h: even and odd columns for 4-bit values, the columns for 8-bit ones).
// Weight rows k .. k + 3 of the strip at p (xq: each row's q of those four rows) added into its integer sums.
template <int Bits, int R, typename Sum>
inline void add_quad(const Quad& bytes, const Quad* xq, Sum sum) {
  if constexpr (Bits == 4) {
    Quad even, odd;
    split_nibbles(bytes, even, odd);
    for (int r = 0; r < R; ++r) {
      sum(r, 0) = dot_small(sum(r, 0), even, xq[r]);
      sum(r, 1) = dot_small(sum(r, 1), odd, xq[r]);
    }
  } else {
    const Quad v = offset_q(bytes);
    for (int r = 0; r < R; ++r) sum(r, 0) = dot_signed(sum(r, 0), v, xq[r]);
  }
}
template <int Bits, int R, typename Sum>
inline void add_strip_quad(const uint8_t* p, int64_t row_bytes, const Quad* xq, Sum sum) {
  add_quad<Bits, R>(gather_rows(p, row_bytes), xq, sum);
}
// kWideStrips strips' quads (sum(r, j, h): strip j of the unit, its lanes in wide_byte order).
template <int Bits, int R, typename Sum>
inline void add_wide_quad(const uint8_t* p, int64_t row_bytes, const Quad* xq, Sum sum) {
  Quad quads[kWideStrips];
  wide_quads(p, row_bytes, quads);
  for (int j = 0; j < kWideStrips; ++j)
    add_quad<Bits, R>(quads[j], xq, [&](int r, int h) -> Ints& { return sum(r, j, h); });
}

// Block b's integer sums (sum(r, h)) times the block's scales and d, plus its mins times s (`mins`), added to the
// float sums acc(r, h): one fused multiply-add chain per column, blocks in order.
template <int Bits, int R, typename Sum, typename Acc>
inline void fold_block(const RoundedRows& x, int64_t m0, int64_t KB, int64_t b, const Vec* scale, const Vec* min,
                       bool mins, Sum sum, Acc acc) {
  constexpr int H = Bits == 4 ? 2 : 1;
  for (int r = 0; r < R; ++r) {
    const int64_t rb = (m0 + r) * KB + b;
    const Vec d = splat(x.d[rb]), shift = splat(x.s[rb]);
    for (int h = 0; h < H; ++h) {
      Ints total = Bits == 4 ? widen_small(sum(r, h)) : sum(r, h);
      if constexpr (Bits == 8) total -= kOffset * x.qsum[rb];  // 8-bit weights offset by 128 added 128 sum(q)
      Vec& a = acc(r, h);
      a = fma(__builtin_convertvector(total, Vec), scale[h] * d, mins ? fma(min[h], shift, a) : a);
    }
  }
}

// fold_block for a strip of a [K, N] weight: the one starting at output column `column` (wide < 0), or strip `wide`
// of the unit of kWideStrips starting there (its lanes in wide_byte order).
template <int Bits, int R, typename Sum, typename Acc>
inline void fold_strip_block(const RoundedRows& x, int64_t m0, const Blocks& q, int64_t N, int64_t b, int64_t column,
                             int wide, Sum sum, Acc acc) {
  Vec scale[2], min[2] = {};
  const int64_t i = b * N + column;
  if constexpr (Bits == 4) {
    if (wide < 0) {
      block_pairs(q, q.scales, i, 2 * kLanes, scale[0], scale[1]);
      if (q.mins) block_pairs(q, q.mins, i, 2 * kLanes, min[0], min[1]);
    } else {
      wide_pairs(q, q.scales, i, wide, scale[0], scale[1]);
      if (q.mins) wide_pairs(q, q.mins, i, wide, min[0], min[1]);
    }
  } else {
    scale[0] = wide < 0 ? q.vector(q.scales, i, kLanes) : wide_values(q, q.scales, i, wide);
    if (q.mins) min[0] = wide < 0 ? q.vector(q.mins, i, kLanes) : wide_values(q, q.mins, i, wide);
  }
  fold_block<Bits, R>(x, m0, q.KB, b, scale, min, q.mins != nullptr, sum, acc);
}

// The strip's float sums written to its output columns (4-bit: even and odd columns interleaved back); `column` and
// `wide` as for fold_strip_block.
template <int Bits, int R, typename Acc>
inline void store_strip(float* out, int64_t m0, int64_t N, int64_t column, int wide, Acc acc) {
  for (int r = 0; r < R; ++r) {
    float* row = out + (m0 + r) * N + column;
    for (int i = 0; i < kLanes; ++i) {
      const int byte = wide < 0 ? i : wide_byte(wide, i);
      if constexpr (Bits == 4) row[2 * byte] = acc(r, 0)[i], row[2 * byte + 1] = acc(r, 1)[i];
      else row[byte] = acc(r, 0)[i];
    }
  }
}

// Columns of kGroupStrips strips at a time: a block's rows of them are 2 cache lines each for 4-bit values (one
// line pair, which the hardware fetches together), 4 for 8-bit ones.
constexpr int kGroupStrips = kLanes == 16 ? 8 : 16;

// Rows m0 .. m0 + R of x by the strips [s0, s0 + G) of a [K, N] weight (4-bit packed, or 8-bit): their output
// columns. Block by block, C strips at a time down the block's rows with their integer sums in registers, folded
// into the group's float sums (in L1) at the block's end; the next block's rows of those strips are fetched
// meanwhile (the rows lie N / 2 or N bytes apart, too far for the hardware's prefetcher to follow).
template <int Bits, int R, int C>
void int8_group(const RoundedRows& x, int64_t m0, int64_t K, const uint8_t* w, int64_t N, int64_t s0, int G,
                const Blocks& q, float* out) {
  constexpr int H = Bits == 4 ? 2 : 1;  // even and odd columns, or the columns
  const int64_t Kb = K / q.KB, row_bytes = Bits == 4 ? N / 2 : N;
  Vec acc[R][kGroupStrips][H] = {};
  auto pass = [&](int64_t b, int c0, auto strips) {  // strips c0 .. c0 + C of the group over block b
    constexpr int P = decltype(strips)::value;
    Ints sums[R][P][H] = {};
    const uint8_t* first = w + b * Kb * row_bytes + (s0 + c0) * kLanes;
    const bool fetch = b + 1 < q.KB && (s0 + c0) * kLanes % 64 == 0;
    for (int64_t i = 0; i < Kb; i += 4) {
      if (fetch)
        for (int j = 0; j < 4; ++j) __builtin_prefetch(first + (Kb + i + j) * row_bytes);
      Quad xq[R];
      for (int r = 0; r < R; ++r) xq[r] = broadcast_q(x.q.data() + (m0 + r) * K + b * Kb + i);
      for (int c = 0; c < P; ++c)  // strip c0 + c's bytes of weight row b Kb + i
        add_strip_quad<Bits, R>(first + i * row_bytes + c * kLanes, row_bytes, xq,
                                [&](int r, int h) -> Ints& { return sums[r][c][h]; });
    }
    for (int c = 0; c < P; ++c)
      fold_strip_block<Bits, R>(x, m0, q, N, b, (s0 + c0 + c) * kStripColumns<Bits>, -1,
                                [&](int r, int h) -> Ints& { return sums[r][c][h]; },
                                [&](int r, int h) -> Vec& { return acc[r][c0 + c][h]; });
  };
  for (int64_t b = 0; b < q.KB; ++b) {
    int c = 0;
    for (; c + C <= G; c += C) pass(b, c, std::integral_constant<int, C>{});
    for (; c < G; ++c) pass(b, c, std::integral_constant<int, 1>{});
  }
  for (int c = 0; c < G; ++c)
    store_strip<Bits, R>(out, m0, N, (s0 + c) * kStripColumns<Bits>, -1,
                         [&](int r, int h) -> Vec& { return acc[r][c][h]; });
}

// int8_group for one or two rows, where the weight's read sets the pace rather than the sums: kStreamStrips strips
// (hundreds of contiguous bytes of each weight row) at a time, row after row down K, their sums in L1, so the read
// is a stream the hardware prefetches well. The same sums and the same fold as int8_group: the same bits.
constexpr int kStreamStrips = 24 * 16 / kLanes;
constexpr int kStreamRows = 2;  // the most rows streamed so
template <int Bits, int R>
void int8_stream(const RoundedRows& x, int64_t m0, int64_t K, const uint8_t* w, int64_t N, int64_t s0, int G,
                 const Blocks& q, float* out) {
  constexpr int H = Bits == 4 ? 2 : 1;
  const int64_t Kb = K / q.KB, row_bytes = Bits == 4 ? N / 2 : N;
  alignas(64) Vec acc[R][kStreamStrips][H] = {};
  alignas(64) Ints sums[R][kStreamStrips][H];
  const uint8_t* first = w + s0 * kLanes;
  const int wide_end = G / kWideStrips * kWideStrips;  // strips [0, wide_end) gathered kWideStrips at a time
  auto wide = [&](int c) { return c < wide_end ? c % kWideStrips : -1; };
  auto unit_column = [&](int c) { return (s0 + (c < wide_end ? c - c % kWideStrips : c)) * kStripColumns<Bits>; };
  for (int64_t b = 0; b < q.KB; ++b) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < G; ++c)
        for (int h = 0; h < H; ++h) sums[r][c][h] = Ints{};
    for (int64_t k = b * Kb; k < (b + 1) * Kb; k += 4) {
      Quad xq[R];
      for (int r = 0; r < R; ++r) xq[r] = broadcast_q(x.q.data() + (m0 + r) * K + k);
      for (int c = 0; c < G;) {
        const uint8_t* p = first + k * row_bytes + c * kLanes;
        if (c % (64 / kLanes) == 0 && k + 12 <= K)  // a cache line's strips: its rows eight ahead
          for (int j = 0; j < 4; ++j) __builtin_prefetch(p + (8 + j) * row_bytes);
        if (c < wide_end) {
          add_wide_quad<Bits, R>(p, row_bytes, xq, [&](int r, int j, int h) -> Ints& { return sums[r][c + j][h]; });
          c += kWideStrips;
        } else {
          add_strip_quad<Bits, R>(p, row_bytes, xq, [&](int r, int h) -> Ints& { return sums[r][c][h]; });
          ++c;
        }
      }
    }
    for (int c = 0; c < G; ++c)
      fold_strip_block<Bits, R>(x, m0, q, N, b, unit_column(c), wide(c),
                                [&](int r, int h) -> Ints& { return sums[r][c][h]; },
                                [&](int r, int h) -> Vec& { return acc[r][c][h]; });
  }
  for (int c = 0; c < G; ++c)
    store_strip<Bits, R>(out, m0, N, unit_column(c), wide(c), [&](int r, int h) -> Vec& { return acc[r][c][h]; });
}

// Every row of one matrix (x [M, K]) by a [K, N] weight (4-bit packed or 8-bit), output columns [n0, n1)
// (multiples of a strip's columns): one or two rows streamed (int8_stream), more in groups of strips (int8_group),
// each group taking every row group in turn (its bytes then in L2).
template <int Bits, typename X>
void int8_rows_columns(const X* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t n0, int64_t n1,
                       const Blocks& q, float* out) {
  const RoundedRows rounded = round_rows(x, M, K, q.KB);
  const int64_t s1 = n1 / kStripColumns<Bits>;
  if (M <= kStreamRows) {
    for (int64_t s = n0 / kStripColumns<Bits>; s < s1; s += kStreamStrips) {
      const int strips = static_cast<int>(std::min<int64_t>(kStreamStrips, s1 - s));
      if (M == 1) int8_stream<Bits, 1>(rounded, 0, K, w, N, s, strips, q, out);
      else int8_stream<Bits, 2>(rounded, 0, K, w, N, s, strips, q, out);
    }
    return;
  }
  for (int64_t s = n0 / kStripColumns<Bits>; s < s1; s += kGroupStrips) {
    const int strips = static_cast<int>(std::min<int64_t>(kGroupStrips, s1 - s));
    by_row_groups(M, [&](auto rows, int64_t m) {
      constexpr int R = decltype(rows)::value;
      int8_group<Bits, R, kPassStrips<Bits, R>>(rounded, m, K, w, N, s, strips, q, out);
    });
  }
}

// Rows m0 .. m0 + R of x by weight rows [n0, n1) of an 8-bit [N, K] weight (an embedding as a tied lm_head), its
// blocks of Kb = K / KB elements (Kb / 4 lanes a block: a multiple of kLanes, or kLanes / 2, RowMatmul checks).
template <int R>
void int8_transposed_rows(const RoundedRows& x, int64_t m0, int64_t K, const int8_t* w, int64_t n0, int64_t n1,
                          const Blocks& q, float* out, int64_t N) {
  const int64_t Kb = K / q.KB, vectors = K / (4 * kLanes);
  const int lanes_per_block = static_cast<int>(Kb / 4);
  Lanes halves;  // lanes 0 .. kLanes / 2 of the first operand, the rest of the second
  for (int i = 0; i < kLanes; ++i) halves[i] = i < kLanes / 2 ? i : kLanes + i;
  auto lane_blocks = [&](auto value, int64_t v) {  // each lane's value(block) in vector v: one block, or two halves
    const int64_t b = v * 4 * kLanes / Kb;
    const Vec first = splat(value(b));
    return lanes_per_block < kLanes ? __builtin_shuffle(first, splat(value(b + 1)), halves) : first;
  };
  std::vector<Vec> d(R * vectors);  // each lane's d, per row and vector
  std::vector<Ints> offsets(R * vectors);
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < vectors; ++v) {
      d[r * vectors + v] = lane_blocks([&](int64_t b) { return x.d[(m0 + r) * q.KB + b]; }, v);
      Ints offset;
      for (int i = 0; i < kLanes; ++i) offset[i] = kOffset * x.quads[((m0 + r) * K + v * 4 * kLanes) / 4 + i];
      offsets[r * vectors + v] = offset;
    }
  for (int64_t n = n0; n < n1; ++n) {
    Vec acc[R] = {};
    const uint8_t* row = reinterpret_cast<const uint8_t*>(w + n * K);
    __builtin_prefetch(row + 4 * K);
    for (int64_t v = 0; v < vectors; ++v) {
      const Quad wv = offset_q(load_q(row + v * 4 * kLanes));
      const Vec scale = lane_blocks([&](int64_t b) { return q.value(q.scales, n * q.KB + b); }, v);
      for (int r = 0; r < R; ++r) {
        const Ints sum = dot_signed(Ints{}, wv, load_q(reinterpret_cast<const uint8_t*>(x.q.data()) +
                                                       (m0 + r) * K + v * 4 * kLanes)) -
                         offsets[r * vectors + v];
        acc[r] = fma(__builtin_convertvector(sum, Vec), scale * d[r * vectors + v], acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[(m0 + r) * N + n] = tree_sum(acc[r]);
  }
}

template <typename X>
void int8_rows_transposed(const X* x, int64_t M, int64_t K, const int8_t* w, int64_t N, int64_t n0, int64_t n1,
                          const Blocks& q, float* out) {
  const RoundedRows rounded = round_rows(x, M, K, q.KB, /*quads=*/true);
  constexpr int64_t kRowsAtOnce = 64;  // weight rows every row group takes in turn
  for (int64_t n = n0; n < n1; n += kRowsAtOnce) {
    const int64_t e = std::min(n1, n + kRowsAtOnce);
    by_row_groups(M, [&](auto rows, int64_t m) {
      int8_transposed_rows<decltype(rows)::value>(rounded, m, K, w, n, e, q, out, N);
    });
  }
}

}  // namespace rows

#include "row_tiles.h"
