// The decode attention's arithmetic (cache_attention.cc binds it to XLA; the kernel checks of
// tests/kernels/native/row_kernel_check.cc call it directly): see cache_attention.cc for the operands.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "row_kernels.h"

namespace attention {

using rows::fma;
using rows::kLanes;
using rows::Lanes;
using rows::Vec;

struct Shapes {
  int64_t B, T, K, G, H, S;
};

// exp(x) of each lane, for x <= 0 (a score less the largest): x = n ln 2 + r with |r| <= ln 2 / 2, e^r by a
// degree-7 polynomial (Cephes' expf coefficients; within 2 ulp), times 2^n from the exponent bits. Below -87
// (e^x < 2^-125) the result is e^-87: next to the largest score's 1 it adds nothing. Every multiply-add is fused
// by hand, so each lane's bits are the same in every instantiation and whatever lane holds it.
inline Vec exp_lanes(Vec x) {
  const Vec low = Vec{} - 87.0f, magic = Vec{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  x = x < low ? low : x;
  const Vec shifted = fma(x, Vec{} + 1.44269504088896341f, magic);  // n + magic, n = round(x / ln 2)
  const Vec n = shifted - magic;
  Lanes shifted_bits, magic_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof shifted_bits);
  std::memcpy(&magic_bits, &magic, sizeof magic_bits);
  Vec r = fma(n, Vec{} - 0.693359375f, x);  // ln 2 in two parts: the first exact times any n here
  r = fma(n, Vec{} + 2.12194440e-4f, r);
  Vec p = Vec{} + 1.9875691500e-4f;
  p = fma(p, r, Vec{} + 1.3981999507e-3f);
  p = fma(p, r, Vec{} + 8.3334519073e-3f);
  p = fma(p, r, Vec{} + 4.1665795894e-2f);
  p = fma(p, r, Vec{} + 1.6666665459e-1f);
  p = fma(p, r, Vec{} + 5.0000001201e-1f);
  const Vec e = fma(p, r * r, r) + 1.0f;
  return e * rows::as_floats((shifted_bits - magic_bits + 127) << 23);
}

// One query: row b's t-th block entry, kv head k, its g-th query head. It sees the cache slots from .. positions[b,
// 0] - 1 (those before the block; later ones are stale) and then the block's entries in block order: causally, the
// entries up to its own, or with `mask` ([B, T, T], nonzero where query t sees entry u; a draft tree's ancestry),
// those it marks. Its sums run over the entries it sees in that order, each entry's terms in the same lanes,
// whatever the other queries are, so a tree node's result is the bits a decode step gets with its ancestors in the
// cache. V: H / kLanes where the caller knows it (the loops then unrolled, the sums in registers), or 0 for any H.
// `scores`: scratch.
template <int V, typename C>  // C: the cache's element: float, or uint16_t holding bfloat16 (the block's entries)
void attend_query(const float* q, const C* keys, const C* values, const C* block_k, const C* block_v,
                  const int32_t* positions, int32_t from, const uint8_t* mask, const Shapes& d, int64_t b, int64_t t,
                  int64_t k, int64_t g, float* out, std::vector<float>& scores, std::vector<int64_t>& seen) {
  const int64_t H = d.H, vectors = V ? V : (H + kLanes - 1) / kLanes, slot_stride = d.K * H;
  const int tail = V ? kLanes : static_cast<int>(H - (vectors - 1) * kLanes);  // head dims in the last vector
  auto lanes = [&](const auto* p, int64_t i) {
    return i + 1 < vectors || tail == kLanes ? rows::load(p + i * kLanes) : rows::load_partial(p + i * kLanes, tail);
  };
  const int64_t first = std::max<int32_t>(from, 0), cached = std::min<int64_t>(positions[b * d.T], d.S) - first;
  const int64_t past = std::max<int64_t>(cached, 0);
  seen.clear();
  for (int64_t u = 0; u < d.T; ++u)
    if (mask ? mask[(b * d.T + t) * d.T + u] != 0 : u <= t) seen.push_back(u);
  auto entry = [&](const C* cache, const C* block, int64_t j) {  // j < past: a slot; then the block's seen
    return j < past ? cache + (b * d.S + first + j) * slot_stride + k * H
                    : block + ((b * d.T + seen[j - past]) * d.K + k) * H;
  };
  const int64_t n = past + static_cast<int64_t>(seen.size());  // the entries this query sees
  const float* query = q + (((b * d.T + t) * d.K + k) * d.G + g) * H;
  scores.resize((n + kLanes - 1) / kLanes * kLanes);
  float largest = -INFINITY;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {  // four keys' chains at once (one chain waits on the add's latency)
    const C* key[4] = {entry(keys, block_k, j), entry(keys, block_k, j + 1), entry(keys, block_k, j + 2),
                       entry(keys, block_k, j + 3)};
    Vec acc[4] = {};
#pragma GCC unroll 8
    for (int64_t i = 0; i < vectors; ++i) {
      const Vec qi = lanes(query, i);
      for (int m = 0; m < 4; ++m) acc[m] = fma(qi, lanes(key[m], i), acc[m]);
    }
    for (int m = 0; m < 4; ++m) {
      scores[j + m] = rows::tree_sum(acc[m]);
      largest = std::max(largest, scores[j + m]);
    }
  }
  for (; j < n; ++j) {
    const C* key = entry(keys, block_k, j);
    Vec acc = {};
    for (int64_t i = 0; i < vectors; ++i) acc = fma(lanes(query, i), lanes(key, i), acc);
    scores[j] = rows::tree_sum(acc);
    largest = std::max(largest, scores[j]);
  }
  for (j = n; j < static_cast<int64_t>(scores.size()); ++j) scores[j] = largest;  // lanes past n: unused
  for (j = 0; j < n; j += kLanes) {
    const Vec p = exp_lanes(rows::load(scores.data() + j) - largest);
    std::memcpy(scores.data() + j, &p, sizeof p);
  }
  // the weighted values' sums in two chains, the even entries' and the odd ones', added at the end
  constexpr int kSums = V ? V : rows::kMaxHeadDim / kLanes;  // H <= kMaxHeadDim (checked)
  Vec even[kSums] = {}, odd[kSums] = {};
  float total = 0.0f;
  for (j = 0; j + 2 <= n; j += 2) {
    const C *v0 = entry(values, block_v, j), *v1 = entry(values, block_v, j + 1);
    const Vec p0 = Vec{} + scores[j], p1 = Vec{} + scores[j + 1];
    total += scores[j];
    total += scores[j + 1];
#pragma GCC unroll 8
    for (int64_t i = 0; i < vectors; ++i) {
      even[i] = fma(p0, lanes(v0, i), even[i]);
      odd[i] = fma(p1, lanes(v1, i), odd[i]);
    }
  }
  if (j < n) {
    const C* v0 = entry(values, block_v, j);
    total += scores[j];
#pragma GCC unroll 8
    for (int64_t i = 0; i < vectors; ++i) even[i] = fma(Vec{} + scores[j], lanes(v0, i), even[i]);
  }
  Vec sum[kSums];
  for (int64_t i = 0; i < vectors; ++i) sum[i] = even[i] + odd[i];
  float* o = out + (((b * d.T + t) * d.K + k) * d.G + g) * H;
  for (int64_t h = 0; h < H; ++h) o[h] = sum[h / kLanes][h % kLanes] / total;
}

// attend_query for any H: unrolled for 4, 8 or 16 vectors (H = 64 or 128 at every level), else looped.
template <typename C>
void attend_one(const float* q, const C* keys, const C* values, const C* block_k, const C* block_v,
                const int32_t* positions, int32_t from, const uint8_t* mask, const Shapes& d, int64_t b, int64_t t,
                int64_t k, int64_t g, float* out, std::vector<float>& scores, std::vector<int64_t>& seen) {
  const auto run = [&](auto vectors) {
    attend_query<decltype(vectors)::value>(q, keys, values, block_k, block_v, positions, from, mask, d, b, t, k, g,
                                           out, scores, seen);
  };
  if (d.H == 4 * kLanes) return run(std::integral_constant<int, 4>{});
  if (d.H == 8 * kLanes) return run(std::integral_constant<int, 8>{});
  if (d.H == 16 * kLanes) return run(std::integral_constant<int, 16>{});
  run(std::integral_constant<int, 0>{});
}

// Every query of row b and kv head k (its T x G queries), as attend_query.
template <typename C>
void attend_pair(const float* q, const C* keys, const C* values, const C* block_k, const C* block_v,
                 const int32_t* positions, int32_t from, const uint8_t* mask, const Shapes& d, int64_t b, int64_t k,
                 float* out, std::vector<float>& scores, std::vector<int64_t>& seen) {
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t g = 0; g < d.G; ++g)
      attend_one(q, keys, values, block_k, block_v, positions, from, mask, d, b, t, k, g, out, scores, seen);
}

}  // namespace attention
