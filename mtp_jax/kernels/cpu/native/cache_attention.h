// The decode attention's arithmetic (cache_attention.cc binds it to XLA; the kernel checks of
// tests/kernels/native/row_kernel_check.cc call it directly): see cache_attention.cc for the operands.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "row_kernels.h"

namespace attention {

using rows::kLanes;
using rows::Vec;

struct Shapes {
  int64_t B, T, K, G, H, S;
};

// One (row, kv head) pair: its T x G queries, each over the cache slots from[b] .. positions[b, 0] - 1 (those
// before the block; later ones are stale) and then over the block's entries it sees, in block order: causally, the
// entries up to its own, or with `mask` ([B, T, T], nonzero where query t sees entry u; a draft tree's ancestry),
// those it marks. A query's sums run over the entries it sees in that order whatever the others are, so a tree
// node's result is the bits a decode step gets with its ancestors in the cache.
template <typename C>  // the cache's element: float, or uint16_t holding bfloat16 (the block's entries as stored)
void attend_pair(const float* q, const C* keys, const C* values, const C* block_k, const C* block_v,
                 const int32_t* positions, int32_t from, const uint8_t* mask, const Shapes& d,
                 int64_t b, int64_t k, float* out, std::vector<float>& scores, std::vector<int64_t>& seen) {
  const int64_t H = d.H, vectors = (H + kLanes - 1) / kLanes, slot_stride = d.K * H;
  const int tail = static_cast<int>(H - (vectors - 1) * kLanes);  // head dims in the last vector (zeros past them)
  auto lanes = [&](const auto* p, int64_t i) {
    return i + 1 < vectors || tail == kLanes ? rows::load(p + i * kLanes) : rows::load_partial(p + i * kLanes, tail);
  };
  const int64_t first = std::max<int32_t>(from, 0), cached = std::min<int64_t>(positions[b * d.T], d.S) - first;
  const int64_t past = std::max<int64_t>(cached, 0);
  auto entry = [&](const C* cache, const C* block, int64_t j) {  // j < cached: a slot; then the block's seen
    return j < past ? cache + (b * d.S + first + j) * slot_stride + k * H
                    : block + ((b * d.T + seen[j - past]) * d.K + k) * H;
  };
  for (int64_t t = 0; t < d.T; ++t) {
    seen.clear();
    for (int64_t u = 0; u < d.T; ++u)
      if (mask ? mask[(b * d.T + t) * d.T + u] != 0 : u <= t) seen.push_back(u);
    const int64_t n = past + static_cast<int64_t>(seen.size());  // the entries this query sees
    for (int64_t g = 0; g < d.G; ++g) {
      const float* query = q + (((b * d.T + t) * d.K + k) * d.G + g) * H;
      float* o = out + (((b * d.T + t) * d.K + k) * d.G + g) * H;
      scores.resize(n);
      float largest = -INFINITY;
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {  // four keys' chains at once (one chain waits on the add's latency)
        const C* key[4] = {entry(keys, block_k, j), entry(keys, block_k, j + 1), entry(keys, block_k, j + 2),
                               entry(keys, block_k, j + 3)};
        Vec acc[4] = {};
        for (int64_t i = 0; i < vectors; ++i) {
          const Vec qi = lanes(query, i);
          for (int m = 0; m < 4; ++m) acc[m] = rows::fma(qi, lanes(key[m], i), acc[m]);
        }
        for (int m = 0; m < 4; ++m) {
          scores[j + m] = rows::tree_sum(acc[m]);
          largest = std::max(largest, scores[j + m]);
        }
      }
      for (; j < n; ++j) {
        const C* key = entry(keys, block_k, j);
        Vec acc = {};
        for (int64_t i = 0; i < vectors; ++i)
          acc = rows::fma(lanes(query, i), lanes(key, i), acc);
        scores[j] = rows::tree_sum(acc);
        largest = std::max(largest, scores[j]);
      }
      float total = 0.0f;
      Vec sum[rows::kMaxHeadDim / kLanes] = {};  // H <= kMaxHeadDim (checked)
      for (int64_t j = 0; j < n; ++j) {
        const float p = std::exp(scores[j] - largest);
        total += p;
        const C* value = entry(values, block_v, j);
        for (int64_t i = 0; i < vectors; ++i) sum[i] = rows::fma(Vec{} + p, lanes(value, i), sum[i]);
      }
      for (int64_t h = 0; h < H; ++h) o[h] = sum[h / kLanes][h % kLanes] / total;
    }
  }
}

}  // namespace attention
