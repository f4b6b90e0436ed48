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
// before the block; later ones are stale) and then, causally, the block's entries up to its own.
void attend_pair(const float* q, const float* keys, const float* values, const float* block_k,
                 const float* block_v, const int32_t* positions, int32_t from, const Shapes& d, int64_t b, int64_t k,
                 float* out, std::vector<float>& scores) {
  const int64_t H = d.H, vectors = H / kLanes, slot_stride = d.K * H;
  const int64_t first = std::max<int32_t>(from, 0), cached = std::min<int64_t>(positions[b * d.T], d.S) - first;
  auto entry = [&](const float* cache, const float* block, int64_t j) {  // j < cached: a slot; then the block
    return j < cached ? cache + (b * d.S + first + j) * slot_stride + k * H
                      : block + ((b * d.T + j - std::max<int64_t>(cached, 0)) * d.K + k) * H;
  };
  for (int64_t t = 0; t < d.T; ++t) {
    const int64_t n = std::max<int64_t>(cached, 0) + t + 1;  // the entries this query sees
    for (int64_t g = 0; g < d.G; ++g) {
      const float* query = q + (((b * d.T + t) * d.K + k) * d.G + g) * H;
      float* o = out + (((b * d.T + t) * d.K + k) * d.G + g) * H;
      scores.resize(n);
      float largest = -INFINITY;
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {  // four keys' chains at once (one chain waits on the add's latency)
        const float* key[4] = {entry(keys, block_k, j), entry(keys, block_k, j + 1), entry(keys, block_k, j + 2),
                               entry(keys, block_k, j + 3)};
        Vec acc[4] = {};
        for (int64_t i = 0; i < vectors; ++i) {
          const Vec qi = rows::load(query + i * kLanes);
          for (int m = 0; m < 4; ++m) acc[m] = rows::fma(qi, rows::load(key[m] + i * kLanes), acc[m]);
        }
        for (int m = 0; m < 4; ++m) {
          scores[j + m] = rows::tree_sum(acc[m]);
          largest = std::max(largest, scores[j + m]);
        }
      }
      for (; j < n; ++j) {
        const float* key = entry(keys, block_k, j);
        Vec acc = {};
        for (int64_t i = 0; i < vectors; ++i)
          acc = rows::fma(rows::load(query + i * kLanes), rows::load(key + i * kLanes), acc);
        scores[j] = rows::tree_sum(acc);
        largest = std::max(largest, scores[j]);
      }
      float total = 0.0f;
      Vec sum[rows::kMaxHeadDim / kLanes] = {};  // H <= kMaxHeadDim (checked)
      for (int64_t j = 0; j < n; ++j) {
        const float p = std::exp(scores[j] - largest);
        total += p;
        const float* value = entry(values, block_v, j);
        for (int64_t i = 0; i < vectors; ++i) sum[i] = rows::fma(Vec{} + p, rows::load(value + i * kLanes), sum[i]);
      }
      for (int64_t i = 0; i < vectors; ++i)
        for (int lane = 0; lane < kLanes; ++lane) o[i * kLanes + lane] = sum[i][lane] / total;
    }
  }
}

}  // namespace attention
