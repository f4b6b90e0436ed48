// Products of a few activation rows by a weight, each output element summed in one fixed order whatever the number
// of rows: the CPU's matmul for decode steps and verify blocks (mtp_jax/models/cpu_rows.py builds and calls it).
//
//   x       [G, M, K] float32 or bfloat16 (activations, widened exactly in registers)
//   w       [G, K, N], or [G, N, K] when `transposed` (an embedding read as a tied lm_head): float32, bfloat16 or int8
//   scales  [G, 1, N] float32, multiplied into each finished sum (int8's per-output-channel scales; ones otherwise)
//   out     [G, M, N] float32
//
// out[g, m, n] is one chain of fused multiply-adds over k = 0, 1, ..., K - 1 (for `transposed`: 16 chains over the
// residues of k mod 16, then added in a fixed tree), then times scales[g, 0, n]. Rows are taken up to eight at a time
// so that a weight tile is read once for them, but every row's chain is the same instructions on the same values:
// a row's result does not depend on M, on where the row sits, or on how columns are split across threads.
//
// Decode is a read of every weight once per step: a weight is streamed once per group of eight rows, as stored (one
// byte per int8 value), and converted to float32 in registers.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;           // floats per vector
constexpr int kSums = 8192;          // sums of one block (rows x columns) kept in L1
template <int R>
constexpr int kBlock = kSums / R / 16 * 16;  // columns per block
constexpr int kRowsPerPass = 8;      // rows sharing a weight tile
constexpr int kPrefetchRows = 8;    // weight rows read ahead of the sums (the rows of a block lie N apart)
constexpr int kTransposedColumns = 8;  // weight rows per pass when transposed, up to 2 rows (fewer above)

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline float to_float(float v) { return v; }
inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(int8_t v) { return static_cast<float>(v); }

// a * b + c with one rounding, spelled out: left to -ffp-contract, one instantiation of a loop was contracted
// differently from another, and a row's bits then depended on how many rows shared its pass.
inline Vec fma(Vec a, Vec b, Vec c) {
#if defined(__AVX512F__)
  return (Vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  Vec r;
  for (int i = 0; i < kLanes; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#endif
}

template <typename W>
inline Vec load(const W* p) {  // 16 consecutive values as float32 (exact for each type)
  Vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = to_float(p[i]);
  return v;
}

#if defined(__AVX512F__)
template <>
inline Vec load(const float* p) { return (Vec)_mm512_loadu_ps(p); }
template <>
inline Vec load(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (Vec)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
template <>
inline Vec load(const int8_t* p) {
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__)
inline Vec join(__m256 lo, __m256 hi) {
  Vec v;
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  return v;
}
template <>
inline Vec load(const uint16_t* p) {
  auto half = [](const uint16_t* q) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  };
  return join(half(p), half(p + 8));
}
template <>
inline Vec load(const int8_t* p) {
  auto half = [](const int8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  };
  return join(half(p), half(p + 8));
}
#endif

template <typename W>
inline Vec load_partial(const W* p, int count) {  // lanes past `count` are zero
  Vec v = {};
  for (int i = 0; i < count; ++i) v[i] = to_float(p[i]);
  return v;
}

// Columns [n0, n0 + width) of R rows (x: the first row, its stride K) by w [K, N], width <= kBlock. The weight is
// streamed row by row (width contiguous values each), the sums kept in L1; four weight rows are added per pass over
// the sums, each element's chain still k = 0, 1, 2, ... in order.
template <int R, typename X, typename W>
void column_block(const X* x, int64_t K, const W* w, int64_t N, int64_t n0, int width, const float* scales,
                  float* out) {
  const int vectors = (width + kLanes - 1) / kLanes;
  const int tail = width - (vectors - 1) * kLanes;  // values in the last vector
  alignas(64) Vec acc[R][kBlock<R> / kLanes] = {};
  auto weights = [&](int64_t k, int j) {
    const W* p = w + k * N + n0 + j * kLanes;
    return j + 1 < vectors || tail == kLanes ? load(p) : load_partial(p, tail);
  };
  constexpr int kVectorsPerLine = sizeof(W) * kLanes >= 64 ? 1 : 64 / (sizeof(W) * kLanes);
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const bool fetch = k + kPrefetchRows + 4 <= K;
    for (int j = 0; j < vectors; ++j) {
      if (fetch && j % kVectorsPerLine == 0)  // the rows kPrefetchRows ahead: runs of `width` values, N apart
        for (int i = 0; i < 4; ++i) __builtin_prefetch(w + (k + kPrefetchRows + i) * N + n0 + j * kLanes);
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

typedef int32_t Lanes __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline float tree_sum(Vec v) {  // lanes added pairwise in a fixed tree: i + 8, then i + 4, i + 2, i + 1
  v = v + __builtin_shuffle(v, Lanes{8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15});
  v = v + __builtin_shuffle(v, Lanes{4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7});
  v = v + __builtin_shuffle(v, Lanes{2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3});
  v = v + __builtin_shuffle(v, Lanes{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1});
  return v[0];
}

// Weight rows [n0, n0 + C) of w [N, K] against R rows of x: out[r, n] = sum_k x[r, k] w[n, k].
template <int R, int C, typename X, typename W>
void row_block(const X* x, int64_t K, const W* w, int64_t N, int64_t n0, const float* scales, float* out) {
  Vec acc[R][C] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load(w + (n0 + c) * K + k);
    for (int r = 0; r < R; ++r) {
      Vec xv = load(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = fma(xv, wv[c], acc[r][c]);
    }
  }
  if (k < K) {
    int count = static_cast<int>(K - k);
    Vec wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load_partial(w + (n0 + c) * K + k, count);
    for (int r = 0; r < R; ++r) {
      Vec xv = load_partial(x + r * K + k, count);
      for (int c = 0; c < C; ++c) acc[r][c] = fma(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * N + n0 + c] = tree_sum(acc[r][c]) * scales[n0 + c];
}

template <int R, typename X, typename W>
void rows_by_block(const X* x, int64_t K, const W* w, int64_t N, bool transposed, int64_t n0, int64_t n1,
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

// Every row of one matrix (x [M, K], w, out [M, N]) for output columns [n0, n1).
template <typename X, typename W>
void columns(const X* x, int64_t M, int64_t K, const W* w, int64_t N, bool transposed, int64_t n0, int64_t n1,
             const float* scales, float* out) {
  int64_t m = 0;
  for (; m + kRowsPerPass <= M; m += kRowsPerPass)
    rows_by_block<kRowsPerPass>(x + m * K, K, w, N, transposed, n0, n1, scales, out + m * N);
  switch (M - m) {
    case 7: rows_by_block<7>(x + m * K, K, w, N, transposed, n0, n1, scales, out + m * N); break;
    case 6: rows_by_block<6>(x + m * K, K, w, N, transposed, n0, n1, scales, out + m * N); break;
    case 5: rows_by_block<5>(x + m * K, K, w, N, transposed, n0, n1, scales, out + m * N); break;
    case 4: rows_by_block<4>(x + m * K, K, w, N, transposed, n0, n1, scales, out + m * N); break;
    case 3: rows_by_block<3>(x + m * K, K, w, N, transposed, n0, n1, scales, out + m * N); break;
    case 2: rows_by_block<2>(x + m * K, K, w, N, transposed, n0, n1, scales, out + m * N); break;
    case 1: rows_by_block<1>(x + m * K, K, w, N, transposed, n0, n1, scales, out + m * N); break;
    default: break;
  }
}

// Work split into pieces (a matrix of the batch and a range of its columns); the caller and the pool's threads
// take pieces from a shared counter, and the caller returns once every piece is done (it never waits on a piece no
// one has started: a piece not yet taken is taken by the caller itself).
struct Pieces {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename X, typename W>
ffi::Error run(ffi::ThreadPool pool, const X* x, const W* w, const float* scales, float* out, int64_t G, int64_t M,
               int64_t K, int64_t N, bool transposed) {
  const int64_t unit = transposed ? kTransposedColumns : 16;  // columns per piece: a multiple of this
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t units = (N + unit - 1) / unit;
  const int64_t per_matrix = std::clamp<int64_t>((threads + G - 1) / G, 1, units);  // one piece per thread
  const int64_t span = (units + per_matrix - 1) / per_matrix * unit;  // columns per piece
  const int64_t total = G * per_matrix;
  auto pieces = std::make_shared<Pieces>();
  auto work = [=]() {
    for (int64_t p; (p = pieces->next.fetch_add(1)) < total;) {
      int64_t g = p / per_matrix, n0 = (p % per_matrix) * span, n1 = std::min(N, n0 + span);
      if (n0 < n1)
        columns(x + g * M * K, M, K, w + g * K * N, N, transposed, n0, n1, scales + g * N, out + g * M * N);
      pieces->done.fetch_add(1);
    }
  };
  for (int64_t t = 1; t < std::min(threads, total); ++t) pool.Schedule([work] { work(); });
  work();
  while (pieces->done.load() < total) std::this_thread::yield();
  return ffi::Error::Success();
}

template <typename X>
ffi::Error with_weights(ffi::ThreadPool pool, const X* x, ffi::AnyBuffer w, const float* scales, float* out, int64_t G,
                        int64_t M, int64_t K, int64_t N, bool transposed) {
  switch (w.element_type()) {
    case ffi::F32:
      return run(pool, x, static_cast<const float*>(w.untyped_data()), scales, out, G, M, K, N, transposed);
    case ffi::BF16:
      return run(pool, x, static_cast<const uint16_t*>(w.untyped_data()), scales, out, G, M, K, N, transposed);
    case ffi::S8:
      return run(pool, x, static_cast<const int8_t*>(w.untyped_data()), scales, out, G, M, K, N, transposed);
    default:
      return ffi::Error::InvalidArgument("row_matmul: weights must be float32, bfloat16 or int8");
  }
}

ffi::Error RowMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scales,
                     ffi::ResultBuffer<ffi::F32> out, int64_t transposed) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 3 || wd.size() != 3 || scales.dimensions().size() != 3)
    return ffi::Error::InvalidArgument("row_matmul: x, w and scales must be 3-d");
  const int64_t G = xd[0], M = xd[1], K = xd[2];
  const int64_t N = transposed ? wd[1] : wd[2];
  if (wd[0] != G || (transposed ? wd[2] : wd[1]) != K)
    return ffi::Error::InvalidArgument("row_matmul: x and w do not share G and K");
  const float* sp = scales.typed_data();
  float* op = out->typed_data();
  switch (x.element_type()) {
    case ffi::F32:
      return with_weights(pool, static_cast<const float*>(x.untyped_data()), w, sp, op, G, M, K, N, transposed != 0);
    case ffi::BF16:
      return with_weights(pool, static_cast<const uint16_t*>(x.untyped_data()), w, sp, op, G, M, K, N,
                          transposed != 0);
    default:
      return ffi::Error::InvalidArgument("row_matmul: activations must be float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpJaxRowMatmul, RowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("transposed"));
