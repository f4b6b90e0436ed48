// The row kernel's XLA binding: products of a few activation rows by a weight, each output element summed in one
// fixed order whatever the number of rows (row_kernels.h): the CPU's matmul for decode steps and verify blocks
// (mtp_jax/kernels/cpu/cpu_rows.py builds and calls it).
//
//   x       [G, M, K] float32 or bfloat16 (activations, widened exactly in registers)
//   w       [G, K, N], or [G, N, K] when `transposed` (an embedding read as a tied lm_head): float32, bfloat16, int8,
//           or (`packed`) 4-bit values 0..15, two to a byte along the last axis, the even index in the low nibble
//   scales  [G, KB, N] ([G, N, KB] when `transposed`) float32 or float16: one per output column and per block of
//           K / KB consecutive contracting elements (KB = 1: int8's per-output-channel scales; ones otherwise)
//   mins    the same shape and type as scales, or empty: added per block, times the block's sum of x (4-bit blocks
//           as llama.cpp's Q4_1 stores them: w = value * scale + min)
//   int8_rows  (attribute) 4-bit weights [G, K, N] or int8 weights in blocks ([G, K, N] or [G, N, K]), the shapes
//           `rows::int8_rows_reads` takes: x's rows rounded to int8 per block first, the blocks' products summed as
//           integers (row_int8.h)
//   tiled   (attribute) with int8_rows, a weight [G, K, N] whose values, scales and mins are stored in tile order
//           (row_tiles.h), N a whole number of tiles
//   first   int32 scalar: w, scales and mins hold S >= first + G matrices, of which first .. first + G - 1 are read
//           (a layer's weight read in place from a stack of layers; 0 for a single weight)
//   out     [G, M, N] float32

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "row_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace rows {  // built in their own units (row_columns.cc)
extern template ROWS_COLUMNS(float, float);
extern template ROWS_COLUMNS(float, uint16_t);
extern template ROWS_COLUMNS(float, int8_t);
extern template ROWS_COLUMNS(float, U4);
extern template ROWS_COLUMNS(uint16_t, float);
extern template ROWS_COLUMNS(uint16_t, uint16_t);
extern template ROWS_COLUMNS(uint16_t, int8_t);
extern template ROWS_COLUMNS(uint16_t, U4);
}  // namespace rows

namespace {

using rows::Blocks;
using rows::kLanes;
using rows::kTransposedColumns;
using rows::U4;
using rows::Weights;

// Work split into pieces (a matrix of the batch and a range of its columns); the caller and the pool's threads
// take pieces from a shared counter, and the caller returns once every piece is done (it never waits on a piece no
// one has started: a piece not yet taken is taken by the caller itself).
struct Pieces {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename X, typename W>
ffi::Error run(ffi::ThreadPool pool, const X* x, Weights<W> w, const Blocks& q, float* out, int64_t G, int64_t M,
               int64_t K, int64_t N, bool transposed) {
  const int64_t unit = transposed ? kTransposedColumns : 32;  // columns per piece: a multiple of this
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t units = (N + unit - 1) / unit;
  const int64_t per_matrix = std::clamp<int64_t>((threads + G - 1) / G, 1, units);  // one piece per thread
  const int64_t span = (units + per_matrix - 1) / per_matrix * unit;  // columns per piece
  const int64_t total = G * per_matrix;
  auto pieces = std::make_shared<Pieces>();
  auto work = [=]() {
    for (int64_t p; (p = pieces->next.fetch_add(1)) < total;) {
      int64_t g = p / per_matrix, n0 = (p % per_matrix) * span, n1 = std::min(N, n0 + span);
      if (n0 < n1) {
        Weights<W> matrix = w;
        matrix.data = reinterpret_cast<decltype(w.data)>(w.address(g * K * N));
        rows::columns(x + g * M * K, M, K, matrix, N, transposed, n0, n1, q.at_matrix(g, N), out + g * M * N);
      }
      pieces->done.fetch_add(1);
    }
  };
  for (int64_t t = 1; t < std::min(threads, total); ++t) pool.Schedule([work] { work(); });
  work();
  while (pieces->done.load() < total) std::this_thread::yield();
  return ffi::Error::Success();
}

template <typename X>
ffi::Error with_weights(ffi::ThreadPool pool, const X* x, ffi::DataType type, const void* data, bool packed,
                        const Blocks& q, float* out, int64_t G, int64_t M, int64_t K, int64_t N, bool transposed) {
  switch (type) {
    case ffi::F32:
      return run(pool, x, Weights<float>{static_cast<const float*>(data)}, q, out, G, M, K, N, transposed);
    case ffi::BF16:
      return run(pool, x, Weights<uint16_t>{static_cast<const uint16_t*>(data)}, q, out, G, M, K, N, transposed);
    case ffi::S8:
      return run(pool, x, Weights<int8_t>{static_cast<const int8_t*>(data)}, q, out, G, M, K, N, transposed);
    case ffi::U8:
      if (packed)
        return run(pool, x, Weights<U4>{static_cast<const uint8_t*>(data)}, q, out, G, M, K, N, transposed);
      [[fallthrough]];
    default:
      return ffi::Error::InvalidArgument("row_matmul: weights must be float32, bfloat16, int8 or packed 4-bit");
  }
}

ffi::Error RowMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                     ffi::AnyBuffer mins, ffi::Buffer<ffi::S32> first_matrix, ffi::ResultBuffer<ffi::F32> out,
                     int64_t transposed, int64_t packed, int64_t int8_rows, int64_t tiled) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto sd = scales.dimensions();
  if (xd.size() != 3 || wd.size() != 3 || sd.size() != 3)
    return ffi::Error::InvalidArgument("row_matmul: x, w and scales must be 3-d");
  const int64_t G = xd[0], M = xd[1], K = xd[2];
  const int64_t last = packed ? 2 * wd[2] : wd[2];  // values along the weight's last axis
  const int64_t N = transposed ? wd[1] : last;
  const int64_t KB = transposed ? sd[2] : sd[1];
  if (first_matrix.element_count() != 1) return ffi::Error::InvalidArgument("row_matmul: first must be a scalar");
  const int64_t first = first_matrix.typed_data()[0];
  if (first < 0 || first + G > wd[0] || (transposed ? last : wd[1]) != K)
    return ffi::Error::InvalidArgument("row_matmul: x and w do not share K, or w has no matrices first .. first + G");
  if (sd[0] != wd[0] || (transposed ? sd[1] : sd[2]) != N || KB < 1 || K % KB != 0)
    return ffi::Error::InvalidArgument("row_matmul: scales are not [S, KB, N] ([S, N, KB] transposed) for KB | K");
  const bool half = scales.element_type() == ffi::F16;
  if (!half && scales.element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("row_matmul: scales must be float32 or float16");
  const bool has_mins = mins.element_count() > 0;
  if (has_mins && (mins.element_type() != scales.element_type() || mins.element_count() != scales.element_count()))
    return ffi::Error::InvalidArgument("row_matmul: mins must be empty or match the scales");
  const bool blocked = KB > 1 || has_mins || half;
  if (blocked && transposed && (K / KB) % kLanes != 0)
    return ffi::Error::InvalidArgument("row_matmul: blocks of a transposed weight must be whole vectors");
  if ((blocked && w.element_type() != ffi::S8 && !packed) || (packed && !blocked))
    return ffi::Error::InvalidArgument("row_matmul: blocks, float16 scales or mins need int8 or 4-bit weights, "
                                       "and 4-bit weights need them");
  if (int8_rows && !rows::int8_rows_reads(packed != 0, w.element_type() == ffi::S8, transposed != 0, K, N, KB))
    return ffi::Error::InvalidArgument("row_matmul: int8 rows need 4-bit weights [G, K, N] or int8 ones in blocks, "
                                       "of the shapes rows::int8_rows_reads takes");
  if (tiled && !(int8_rows && !transposed && rows::tiles_read(packed != 0, K, N, KB)))
    return ffi::Error::InvalidArgument("row_matmul: a weight in tile order needs int8 rows and a [G, K, N] weight "
                                       "of whole tiles");
  const Blocks stack{scales.untyped_data(), has_mins ? mins.untyped_data() : nullptr, half, KB, int8_rows != 0,
                     tiled != 0};
  const Blocks q = stack.at_matrix(first, N);
  const int64_t matrix_bytes = K * N * static_cast<int64_t>(ffi::ByteWidth(w.element_type())) / (packed ? 2 : 1);
  const char* weights = static_cast<const char*>(w.untyped_data()) + first * matrix_bytes;
  float* op = out->typed_data();
  const ffi::DataType type = w.element_type();
  switch (x.element_type()) {
    case ffi::F32:
      return with_weights(pool, static_cast<const float*>(x.untyped_data()), type, weights, packed != 0, q, op, G, M,
                          K, N, transposed != 0);
    case ffi::BF16:
      return with_weights(pool, static_cast<const uint16_t*>(x.untyped_data()), type, weights, packed != 0, q, op, G,
                          M, K, N, transposed != 0);
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
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("transposed")
                                  .Attr<int64_t>("packed")
                                  .Attr<int64_t>("int8_rows")
                                  .Attr<int64_t>("tiled"));

// The ISA level the library was built for ("avx512", "avx2", "sse4", "neon", "neon-dotprod" or "generic"):
// cpu_rows.level() reads it.
extern "C" const char* MtpJaxRowIsa() { return rows::kIsa; }

// How the int8-rows product sums a lane's four integer products ("vpdpbusd", "vpmaddubsw", "sdot", or "none": one
// at a time): cpu_rows.integer_dot() reads it, to choose the default activations.
extern "C" const char* MtpJaxRowIntegerDot() { return rows::kIntegerDot; }
