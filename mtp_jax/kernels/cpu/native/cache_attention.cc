// Decode attention over a layer's cache in one call (mtp_jax/kernels/cpu/cpu_attention.py binds it): every query attends
// to the cache before its block, reading keys and values where they lie in the stacked cache, and causally to the
// block's own entries; batch-invariant by construction.
//
//   q        [B, T, K, G, H] float32 queries, already scaled (K kv heads, G queries per kv head)
//   cache_k  [L, B, S, K, H] float32 or bfloat16 (cache_v the same); layer `layer` (int32 scalar) is read
//   block_k  [B, T, K, H] the cache's type (block_v the same): the entries this block writes at positions[b, 0] ..
//            + T - 1, as the cache will hold them
//   positions [B, T] int32, contiguous per row; from [B] int32: slots before it are not seen (0: all)
//   mask     [B, T, T] uint8, or empty: the block entries each query sees (a draft tree's ancestry; empty: causally)
//   out      [B, T, K, G, H] float32
//
// The t-th query of row b sees the cache slots from[b] .. positions[b, 0] - 1, then the block's entries 0 .. t, or
// those mask[b, t] marks, in block order (the order of the slots they are written to): entries j = 0 .. n - 1.
// score_j = q . key_j (kLanes chains over H, added in a fixed tree), m = the largest score, p_j = exp(score_j - m)
// (attention::exp_lanes), out = (the p_j value_j of even j summed in order + those of odd j) / (the p_j summed in
// order). Work is split one query a piece.
// Nothing in a query's result depends on the other queries of the pass, their rows or their number.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "cache_attention.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using attention::Shapes;

constexpr int64_t kClaimsPerThread = 16;  // runs of queries each thread takes, on average, where there are many
constexpr int64_t kMaxClaim = 64;

template <typename C>
ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache_k, ffi::AnyBuffer cache_v,
                  ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer block_k, ffi::AnyBuffer block_v,
                  ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> from, ffi::Buffer<ffi::U8> mask,
                  ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), cd = cache_k.dimensions(), bd = block_k.dimensions();
  if (qd.size() != 5 || cd.size() != 5 || bd.size() != 4)
    return ffi::Error::InvalidArgument("cache_attention: q is [B, T, K, G, H], caches [L, B, S, K, H], blocks [B, T, K, H]");
  const Shapes d{qd[0], qd[1], qd[2], qd[3], qd[4], cd[2]};
  if (cd[1] != d.B || cd[3] != d.K || cd[4] != d.H || bd[0] != d.B || bd[1] != d.T || bd[2] != d.K || bd[3] != d.H ||
      cache_v.element_count() != cache_k.element_count() || block_v.element_count() != block_k.element_count() ||
      d.H < 1 || d.H > rows::kMaxHeadDim || positions.element_count() != d.B * d.T || from.element_count() != d.B ||
      (mask.element_count() != 0 && mask.element_count() != d.B * d.T * d.T))
    return ffi::Error::InvalidArgument("cache_attention: shapes do not agree, or H is not 1 to 128");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= cd[0]) return ffi::Error::InvalidArgument("cache_attention: layer out of range");
  const int64_t layer_size = d.B * d.S * d.K * d.H;
  const C* keys = static_cast<const C*>(cache_k.untyped_data()) + l * layer_size;
  const C* values = static_cast<const C*>(cache_v.untyped_data()) + l * layer_size;
  const int64_t queries = d.B * d.T * d.K * d.G;  // the pieces of work: one query each
  const float* qp = q.typed_data();
  const C *bk = static_cast<const C*>(block_k.untyped_data()), *bv = static_cast<const C*>(block_v.untyped_data());
  const int32_t *pp = positions.typed_data(), *fp = from.typed_data();
  const uint8_t* mp = mask.element_count() ? mask.typed_data() : nullptr;
  float* op = out->typed_data();
  // Threads claim runs of `claim` queries: one query a claim where there are few (a batch-1 step's 9 queries
  // balance over the threads), up to kMaxClaim where there are many, so that the shared counters are not touched
  // once per query.
  const int64_t threads = pool.num_threads() + 1;
  const int64_t claim = std::clamp<int64_t>(queries / (kClaimsPerThread * threads), 1, kMaxClaim);
  auto next = std::make_shared<std::atomic<int64_t>>(0);
  auto done = std::make_shared<std::atomic<int64_t>>(0);
  auto work = [=]() {
    std::vector<float> scores;
    std::vector<int64_t> seen;
    for (int64_t first; (first = next->fetch_add(claim)) < queries;) {
      const int64_t last = std::min(first + claim, queries);
      for (int64_t p = first; p < last; ++p) {
        const int64_t g = p % d.G, k = p / d.G % d.K, t = p / (d.G * d.K) % d.T, b = p / (d.G * d.K * d.T);
        attention::attend_one(qp, keys, values, bk, bv, pp, fp[b], mp, d, b, t, k, g, op, scores, seen);
      }
      done->fetch_add(last - first);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), queries - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  while (done->load() < queries) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache_k,
                          ffi::AnyBuffer cache_v, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer block_k,
                          ffi::AnyBuffer block_v, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> from,
                          ffi::Buffer<ffi::U8> mask, ffi::ResultBuffer<ffi::F32> out) {
  const auto type = cache_k.element_type();
  if (cache_v.element_type() != type || block_k.element_type() != type || block_v.element_type() != type)
    return ffi::Error::InvalidArgument("cache_attention: the caches and the block's entries are not of one type");
  if (type == ffi::DataType::F32)
    return Attend<float>(pool, q, cache_k, cache_v, layer, block_k, block_v, positions, from, mask, out);
  if (type == ffi::DataType::BF16)
    return Attend<uint16_t>(pool, q, cache_k, cache_v, layer, block_k, block_v, positions, from, mask, out);
  return ffi::Error::InvalidArgument("cache_attention: caches of float32 or bfloat16 only");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpJaxCacheAttention, CacheAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
