// The int8-rows product (row_int8.h) for a [K, N] weight stored in tile order (`Blocks::tiled`; written on load by
// mtp_jax/quant/row_tiles.py), where the weight is one stream read front to back.
//
// Stored as rows ([K, N], N / 2 bytes a row for 4-bit values, N for 8-bit ones), the bytes a quad of four rows
// needs lie a row apart: a strip's read jumps N / 2 or N bytes at every row and the hardware's prefetcher follows
// few such streams. In tile order a weight is cut into tiles of kTileBytes bytes of every row (32 output columns of
// 4-bit values, 16 of 8-bit ones), stored tile after tile, each tile block after block (K / KB rows a block), each
// block quad after quad of rows, a quad's 64 bytes with row j's byte i at 4 i + j: lane i of a quad already, one
// load. The scales and mins ([KB, N]) are stored tile after tile, block after block: a block's 16 even columns'
// values then its 16 odd ones' (4-bit), or its 16 columns' (8-bit). A tile's sums are those of row_int8.h's strips
// (the same integer sums, the same fold, blocks in order): the same bits as the weight stored as rows.

#pragma once

namespace rows {

constexpr int kTileBytes = 16;  // bytes of each weight row a tile (a quad of its rows: 64 bytes)
template <int Bits>
constexpr int kTileColumns = Bits == 4 ? 2 * kTileBytes : kTileBytes;
// How far ahead of the block being summed its stream is fetched, in blocks of a tile (one block: Kb quads of 64
// bytes, 512 bytes for Kb = 32; its scales and mins one or two cache lines each). Left to itself the hardware's
// prefetcher runs too little ahead of a stream this fast, and a pass waits on memory, then sums, in turn; fetched
// 16 blocks (8 KB of values) ahead, the reads overlap the sums.
constexpr int64_t kPrefetchBlocks = 16;

// Whether a weight in tile order can be read so: int8_rows_reads' [K, N] shapes with N a whole number of tiles.
inline bool tiles_read(bool packed, int64_t K, int64_t N, int64_t KB) {
  return int8_rows_reads(packed, !packed, false, K, N, KB) && N % (packed ? kTileColumns<4> : kTileColumns<8>) == 0;
}

// The cache lines of the scales and mins (`Blocks`) from value index `first` on: one block of a tile's.
template <int Bits>
inline void prefetch_blocks_ahead(const Blocks& q, int64_t first) {
  const int64_t bytes = q.half ? 2 : 4, span = kTileColumns<Bits> * bytes;  // a block's scales of a tile
  for (int64_t line = 0; line < span; line += 64) {
    __builtin_prefetch(static_cast<const char*>(q.scales) + first * bytes + line);
    if (q.mins) __builtin_prefetch(static_cast<const char*>(q.mins) + first * bytes + line);
  }
}

// Rows m0 .. m0 + R of x by tile t of a weight in tile order: its output columns. kTileBytes / kLanes strips a tile
// (one with AVX512, two with AVX2, four elsewhere), each strip's sums in registers down a block's rows.
template <int Bits, int R>
void tile_rows(const RoundedRows& x, int64_t m0, int64_t K, const uint8_t* w, int64_t N, int64_t t, const Blocks& q,
               float* out) {
  constexpr int H = Bits == 4 ? 2 : 1, S = kTileBytes / kLanes;
  const int64_t Kb = K / q.KB;
  Vec acc[R][S][H] = {};
  const uint8_t* tile = w + t * K * kTileBytes;
  for (int64_t b = 0; b < q.KB; ++b) {
    const uint8_t* block = tile + b * Kb * kTileBytes;
    const int64_t values = (t * q.KB + b) * kTileColumns<Bits>;  // the block's first scale
    for (int64_t i = 0; i < Kb; i += 4) __builtin_prefetch(block + (kPrefetchBlocks * Kb + i) * kTileBytes);
    prefetch_blocks_ahead<Bits>(q, values + kPrefetchBlocks * kTileColumns<Bits>);
    for (int s = 0; s < S; ++s) {
      Ints sums[R][H] = {};
      for (int64_t i = 0; i < Kb; i += 4) {  // quad i / 4 of the block: kTileBytes bytes of each of its four rows
        Quad xq[R];
        for (int r = 0; r < R; ++r) xq[r] = broadcast_q(x.q.data() + (m0 + r) * K + b * Kb + i);
        add_quad<Bits, R>(load_q(block + i * kTileBytes + s * 4 * kLanes), xq,
                          [&](int r, int h) -> Ints& { return sums[r][h]; });
      }
      Vec scale[H], min[H] = {};
      for (int h = 0; h < H; ++h) {
        scale[h] = q.vector(q.scales, values + h * kTileBytes + s * kLanes, kLanes);
        if (q.mins) min[h] = q.vector(q.mins, values + h * kTileBytes + s * kLanes, kLanes);
      }
      fold_block<Bits, R>(x, m0, q.KB, b, scale, min, q.mins != nullptr,
                          [&](int r, int h) -> Ints& { return sums[r][h]; },
                          [&](int r, int h) -> Vec& { return acc[r][s][h]; });
    }
  }
  for (int r = 0; r < R; ++r) {
    float* row = out + (m0 + r) * N + t * kTileColumns<Bits>;
    for (int s = 0; s < S; ++s)
      for (int i = 0; i < kLanes; ++i) {
        const int byte = s * kLanes + i;  // the tile's byte of a row: 4-bit columns 2 byte (even) and 2 byte + 1
        if constexpr (Bits == 4) row[2 * byte] = acc[r][s][0][i], row[2 * byte + 1] = acc[r][s][1][i];
        else row[byte] = acc[r][s][0][i];
      }
  }
}

// Every row of one matrix (x [M, K]) by a weight in tile order, output columns [n0, n1) (whole tiles): tile by tile,
// each taking every group of rows in turn (its bytes then in L1).
template <int Bits, typename X>
void int8_tiles_columns(const X* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t n0, int64_t n1,
                        const Blocks& q, float* out) {
  const RoundedRows rounded = round_rows(x, M, K, q.KB);
  for (int64_t t = n0 / kTileColumns<Bits>; t < n1 / kTileColumns<Bits>; ++t)
    by_row_groups(M, [&](auto rows, int64_t m) {
      tile_rows<Bits, decltype(rows)::value>(rounded, m, K, w, N, t, q, out);
    });
}

}  // namespace rows
