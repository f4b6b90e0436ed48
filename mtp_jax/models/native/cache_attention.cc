// Batch-invariant decode attention over a layer's cache in one call (mtp_jax/models/cpu_attention.py binds it):
// every query attends to the slots up to its own position, reading keys and values where they lie in the stacked
// cache, the block's own entries in place of the slots they are written to.
//
//   q        [B, T, K, G, H] float32 queries, already scaled (K kv heads, G queries per kv head)
//   cache_k  [L, B, S, K, H] float32 (cache_v the same); layer `layer` (int32 scalar) is read
//   block_k  [B, T, K, H] float32 (block_v the same): the entries this block writes at positions[b, 0] .. + T - 1
//   positions [B, T] int32, contiguous per row; from [B] int32: slots before it are not seen (0: all)
//   out      [B, T, K, G, H] float32
//
// A query at position p of row b sees slots from[b] .. p: score_s = q . key_s (16 lane chains over H, added in a
// fixed tree), m = the largest score, out = sum_s exp(score_s - m) value_s / sum_s exp(score_s - m), both sums in
// slot order. Nothing in a query's result depends on the other queries of the pass, their rows or their number.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "row_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using rows::kLanes;
using rows::Vec;

struct Shapes {
  int64_t B, T, K, G, H, S;
};

// One (row, kv head) pair: its T x G queries over their visible slots.
void attend_pair(const float* q, const float* keys, const float* values, const float* block_k,
                 const float* block_v, const int32_t* positions, int32_t from, const Shapes& d, int64_t b, int64_t k,
                 float* out, std::vector<float>& scores) {
  const int64_t H = d.H, vectors = H / kLanes, slot_stride = d.K * H;
  const int64_t start = positions[b * d.T];
  auto key_of = [&](int64_t s) {  // the slot's key as this pass sees it: the block's where it writes
    const int64_t i = s - start;
    return i >= 0 && i < d.T ? block_k + ((b * d.T + i) * d.K + k) * H : keys + (b * d.S + s) * slot_stride + k * H;
  };
  auto value_of = [&](int64_t s) {
    const int64_t i = s - start;
    return i >= 0 && i < d.T ? block_v + ((b * d.T + i) * d.K + k) * H : values + (b * d.S + s) * slot_stride + k * H;
  };
  for (int64_t t = 0; t < d.T; ++t) {
    const int64_t last = std::min<int64_t>(positions[b * d.T + t], d.S - 1), first = std::max<int32_t>(from, 0);
    for (int64_t g = 0; g < d.G; ++g) {
      const float* query = q + (((b * d.T + t) * d.K + k) * d.G + g) * H;
      float* o = out + (((b * d.T + t) * d.K + k) * d.G + g) * H;
      if (last < first) {
        std::fill(o, o + H, 0.0f);
        continue;
      }
      const int64_t n = last - first + 1;
      scores.resize(n);
      float largest = -INFINITY;
      for (int64_t s = first; s <= last; ++s) {
        const float* key = key_of(s);
        Vec acc = {};
        for (int64_t j = 0; j < vectors; ++j)
          acc = rows::fma(rows::load(query + j * kLanes), rows::load(key + j * kLanes), acc);
        const float score = rows::tree_sum(acc);
        scores[s - first] = score;
        largest = std::max(largest, score);
      }
      float total = 0.0f;
      Vec sum[8] = {};  // H / 16 <= 8 (checked)
      for (int64_t s = first; s <= last; ++s) {
        const float p = std::exp(scores[s - first] - largest);
        total += p;
        const float* value = value_of(s);
        for (int64_t j = 0; j < vectors; ++j) sum[j] = rows::fma(Vec{} + p, rows::load(value + j * kLanes), sum[j]);
      }
      for (int64_t j = 0; j < vectors; ++j)
        for (int i = 0; i < kLanes; ++i) o[j * kLanes + i] = sum[j][i] / total;
    }
  }
}

ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cache_k,
                          ffi::Buffer<ffi::F32> cache_v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> block_k,
                          ffi::Buffer<ffi::F32> block_v, ffi::Buffer<ffi::S32> positions,
                          ffi::Buffer<ffi::S32> from, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), cd = cache_k.dimensions(), bd = block_k.dimensions();
  if (qd.size() != 5 || cd.size() != 5 || bd.size() != 4)
    return ffi::Error::InvalidArgument("cache_attention: q is [B, T, K, G, H], caches [L, B, S, K, H], blocks [B, T, K, H]");
  const Shapes d{qd[0], qd[1], qd[2], qd[3], qd[4], cd[2]};
  if (cd[1] != d.B || cd[3] != d.K || cd[4] != d.H || bd[0] != d.B || bd[1] != d.T || bd[2] != d.K || bd[3] != d.H ||
      d.H % kLanes != 0 || d.H > 8 * kLanes || positions.element_count() != d.B * d.T || from.element_count() != d.B)
    return ffi::Error::InvalidArgument("cache_attention: shapes do not agree, or H is not 16, 32, ..., 128");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= cd[0]) return ffi::Error::InvalidArgument("cache_attention: layer out of range");
  const int64_t layer_size = d.B * d.S * d.K * d.H;
  const float* keys = cache_k.typed_data() + l * layer_size;
  const float* values = cache_v.typed_data() + l * layer_size;
  const int64_t pairs = d.B * d.K;
  const float *qp = q.typed_data(), *bk = block_k.typed_data(), *bv = block_v.typed_data();
  const int32_t *pp = positions.typed_data(), *fp = from.typed_data();
  float* op = out->typed_data();
  auto next = std::make_shared<std::atomic<int64_t>>(0);
  auto done = std::make_shared<std::atomic<int64_t>>(0);
  auto work = [=]() {
    std::vector<float> scores;
    for (int64_t p; (p = next->fetch_add(1)) < pairs;) {
      attend_pair(qp, keys, values, bk, bv, pp, fp[p / d.K], d, p / d.K, p % d.K, op, scores);
      done->fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), pairs - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  while (done->load() < pairs) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpJaxCacheAttention, CacheAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
