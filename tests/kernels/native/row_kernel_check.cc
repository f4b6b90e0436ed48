// The row kernel's products and the decode attention (mtp_jax/kernels/cpu/native) against exact references, compiled
// for one ISA level and run on this machine or under qemu-user (tests/kernels/test_kernel_levels_*.py): no JAX, no XLA.
//
// Every weight form the kernel reads (float32, bfloat16, int8 per channel, int8 in blocks with float16 scales as
// GGUF's Q8_0, 4-bit in blocks with scales and mins as Q4_1, 4-bit by int8-rounded rows), both layouts, float32 and
// bfloat16 activations: each product within a float32 tolerance of a double-precision sum, and each row's bits the
// same alone, in every pass of 2 to 9 and 17 rows, and with the columns split at another place. Attention: each
// query within tolerance of a double-precision softmax, and the same bits in a block of one as in a block of three.
// Every float16 value (the blocks' scales) converted as the scalar reference does.
// Prints the level the code was built for ("isa avx2"), one line per failure, and the number of checks.

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cache_attention.h"
#include "row_kernels.h"

using namespace rows;

namespace {

int checks = 0, failures = 0;

void expect(bool ok, const std::string& what) {
  ++checks;
  if (!ok && ++failures <= 20) std::printf("FAIL %s\n", what.c_str());
}

uint16_t to_bf16(float f) {  // truncation: an exact bfloat16 value
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}

uint16_t to_half(float f) {  // a float16 value for f in [2^-14, 2): exponent and 10 mantissa bits, truncated
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const int exponent = static_cast<int>((bits >> 23) & 0xFF) - 127 + 15;
  return static_cast<uint16_t>(((bits >> 16) & 0x8000) | (exponent << 10) | ((bits >> 13) & 0x3FF));
}

// Every float16 value through the level's vector conversion (scales and mins of GGUF's blocks) against the exact
// scalar one: the same bits (any NaN for a NaN: hardware conversions quiet a signalling one).
void check_halves() {
  std::vector<uint16_t> all(65536);
  for (int h = 0; h < 65536; ++h) all[h] = static_cast<uint16_t>(h);
  for (int h = 0; h < 65536; h += kLanes) {
    const Vec v = load_halves(all.data() + h);
    for (int i = 0; i < kLanes; ++i) {
      const float want = half_to_float(all[h + i]), got = v[i];
      const bool same = std::isnan(want) ? std::isnan(got) : std::memcmp(&want, &got, sizeof want) == 0;
      expect(same, "float16 " + std::to_string(h + i) + ": " + std::to_string(got) + " against " +
                       std::to_string(want));
    }
  }
}

struct Case {
  std::string name;
  int64_t K, N, KB;
  bool transposed, half, mins, int8_rows;
  bool extreme = false;  // every 4-bit value 15 and every x of a block's largest magnitude, one sign a row: the
  // largest integer sums a block can make (16-bit pair sums near their limit)
  bool tiled = false;  // [K, N] int8 rows with the weight in tile order (row_tiles.h), as well as as rows
};

// A [K, N] weight's bytes (row_bytes a row) and its scales or mins [KB, N] (`bits`-bit values) in tile order: tiles
// of 16 bytes of every row, block by block, quad of rows by quad, byte i of row j of a quad at 4 i + j; scales tile
// by tile, block by block, 4-bit: the 16 even columns' then the 16 odd ones'.
std::vector<uint8_t> tile_bytes(const std::vector<uint8_t>& rows, int64_t K, int64_t row_bytes) {
  std::vector<uint8_t> tiled(rows.size());
  int64_t at = 0;
  for (int64_t t = 0; t < row_bytes / 16; ++t)
    for (int64_t k = 0; k < K; k += 4)
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t j = 0; j < 4; ++j) tiled[at++] = rows[(k + j) * row_bytes + 16 * t + i];
  return tiled;
}
template <typename T>
std::vector<T> tile_scales(const std::vector<T>& scales, int64_t KB, int64_t N, int bits) {
  std::vector<T> tiled;
  const int64_t columns = bits == 4 ? 32 : 16;
  for (int64_t t = 0; t < N / columns; ++t)
    for (int64_t b = 0; b < KB; ++b)
      for (int64_t h = 0; h < (bits == 4 ? 2 : 1); ++h)
        for (int64_t i = 0; i < 16; ++i) tiled.push_back(scales[b * N + t * columns + (bits == 4 ? 2 * i + h : i)]);
  return tiled;
}

// A weight of form W, its scales and mins as the kernel reads them, and its values as doubles [K][N].
template <typename W>
struct Weight {
  std::vector<uint8_t> bytes;
  std::vector<float> scales32, mins32;
  std::vector<uint16_t> scales16, mins16;
  std::vector<double> dense;  // [K * N]
};

template <typename W>
Weight<W> make_weight(const Case& c, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> level(0, 15), byte(-127, 127);
  std::uniform_real_distribution<float> positive(0.01f, 0.05f), shift(-0.2f, -0.05f);
  Weight<W> w;
  const int64_t K = c.K, N = c.N, Kb = K / c.KB;
  auto at = [&](int64_t k, int64_t n) { return c.transposed ? n * K + k : k * N + n; };
  auto block_at = [&](int64_t b, int64_t n) { return c.transposed ? n * c.KB + b : b * N + n; };
  w.dense.assign(K * N, 0.0);
  std::vector<double> scale(c.KB * N, 1.0), min(c.KB * N, 0.0);
  if (std::is_same_v<W, int8_t> || std::is_same_v<W, U4>) {
    for (int64_t i = 0; i < c.KB * N; ++i) {
      const float s = positive(rng), m = c.mins ? shift(rng) : 0.0f;
      if (c.half) {
        w.scales16.push_back(to_half(s));
        w.mins16.push_back(to_half(-m) | 0x8000);
        scale[i] = half_to_float(w.scales16.back());
        min[i] = c.mins ? half_to_float(w.mins16.back()) : 0.0;
      } else {
        w.scales32.push_back(s);
        scale[i] = s;
      }
    }
  } else {
    w.scales32.assign(N, 1.0f);
  }
  if constexpr (std::is_same_v<W, U4>) {
    w.bytes.assign(K * N / 2, 0);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) {
        const int v = c.extreme ? 15 : level(rng);
        const int64_t i = at(k, n);
        w.bytes[i / 2] |= static_cast<uint8_t>(v << (4 * (i % 2)));
        w.dense[k * N + n] = v * scale[block_at(k / Kb, n)] + min[block_at(k / Kb, n)];
      }
  } else {
    w.bytes.assign(K * N * sizeof(W), 0);
    W* values = reinterpret_cast<W*>(w.bytes.data());
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) {
        double v;
        if constexpr (std::is_same_v<W, float>) values[at(k, n)] = static_cast<float>(v = normal(rng) / 8);
        if constexpr (std::is_same_v<W, uint16_t>) v = to_float(values[at(k, n)] = to_bf16(normal(rng) / 8));
        if constexpr (std::is_same_v<W, int8_t>) v = values[at(k, n)] = static_cast<int8_t>(byte(rng));
        w.dense[k * N + n] = v * scale[block_at(k / Kb, n)] + min[block_at(k / Kb, n)];
      }
  }
  return w;
}

template <typename X, typename W>
void check_product(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const int64_t K = c.K, N = c.N, M = 17, KB = c.KB;
  Weight<W> w = make_weight<W>(c, rng);
  std::vector<X> x(M * K);
  std::vector<double> xd(M * K);
  for (int64_t i = 0; i < M * K; ++i) {
    const float value = c.extreme ? ((i / K) % 2 ? -1.5f : 1.5f) : normal(rng);
    if constexpr (std::is_same_v<X, float>) xd[i] = x[i] = value;
    else xd[i] = to_float(x[i] = to_bf16(value));
  }
  const Blocks as_rows{c.half ? static_cast<const void*>(w.scales16.data()) : w.scales32.data(),
                       c.mins ? static_cast<const void*>(w.mins16.data()) : nullptr, c.half, KB, c.int8_rows};
  const Weights<W> rows_weights{reinterpret_cast<decltype(Weights<W>{}.data)>(w.bytes.data())};
  constexpr int bits = std::is_same_v<W, U4> ? 4 : 8;
  const std::vector<uint8_t> tiled = c.tiled ? tile_bytes(w.bytes, K, bits == 4 ? N / 2 : N) : w.bytes;
  const std::vector<uint16_t> scales16 = c.tiled ? tile_scales(w.scales16, KB, N, bits) : w.scales16;
  const std::vector<uint16_t> mins16 = c.tiled && c.mins ? tile_scales(w.mins16, KB, N, bits) : w.mins16;
  Blocks q = as_rows;
  q.scales = c.half ? static_cast<const void*>(scales16.data()) : w.scales32.data();
  q.mins = c.mins ? static_cast<const void*>(mins16.data()) : nullptr;
  q.tiled = c.tiled;
  const Weights<W> weights{reinterpret_cast<decltype(Weights<W>{}.data)>(tiled.data())};
  auto product = [&](int64_t rows, int64_t first_row, int64_t n0, int64_t n1, std::vector<float>& out) {
    out.assign(rows * N, 0.0f);
    columns(x.data() + first_row * K, rows, K, weights, N, c.transposed, n0, n1, q, out.data());
  };
  std::vector<float> all, part;
  product(M, 0, 0, N, all);
  if (c.tiled) {  // the same bits as the weight stored as rows
    part.assign(M * N, 0.0f);
    columns(x.data(), M, K, rows_weights, N, c.transposed, 0, N, as_rows, part.data());
    expect(std::memcmp(part.data(), all.data(), M * N * sizeof(float)) == 0, c.name + ": the bits of rows");
  }
  const int64_t Kb = K / KB;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double want = 0.0, size = 0.0;
      for (int64_t b = 0; b < KB; ++b) {
        double largest = 0.0;  // int8 rows: x rounded per block as the kernel documents it
        for (int64_t k = b * Kb; k < (b + 1) * Kb; ++k) largest = std::max(largest, std::fabs(xd[m * K + k]));
        const float d = static_cast<float>(largest) / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
        for (int64_t k = b * Kb; k < (b + 1) * Kb; ++k) {
          const double v = c.int8_rows ? d * std::nearbyint(static_cast<float>(xd[m * K + k]) * inverse) : xd[m * K + k];
          want += v * w.dense[k * N + n];
          size += std::fabs(v * w.dense[k * N + n]);
        }
      }
      const double got = all[m * N + n];
      expect(std::fabs(got - want) <= 2e-5 * size + 1e-6,
             c.name + ": row " + std::to_string(m) + " column " + std::to_string(n) + " got " + std::to_string(got) +
                 " want " + std::to_string(want));
    }
  auto same_bits = [&](const std::vector<float>& got, int64_t first_row, int64_t rows, const std::string& what) {
    expect(std::memcmp(got.data(), all.data() + first_row * N, rows * N * sizeof(float)) == 0, c.name + ": " + what);
  };
  for (int64_t m = 0; m < M; ++m) {
    product(1, m, 0, N, part);
    same_bits(part, m, 1, "row " + std::to_string(m) + " alone");
  }
  for (int64_t rows = 2; rows <= 9; ++rows) {
    product(rows, 3, 0, N, part);
    same_bits(part, 3, rows, std::to_string(rows) + " rows from row 3");
  }
  const int64_t split = c.transposed ? 8 : 32 * (N / 64);  // the binding splits columns at such multiples
  product(M, 0, 0, split, part);
  std::vector<float> rest;
  product(M, 0, split, N, rest);
  for (int64_t i = 0; i < M * N; ++i) part[i] = i % N < split ? part[i] : rest[i];
  same_bits(part, 0, M, "columns split at " + std::to_string(split));
}

// `tree`: the block as a draft tree's (entry 0 the root; 1 and 2 its children, each seeing the root and itself)
void check_attention(int64_t H, uint32_t seed, bool tree) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const attention::Shapes d{2, 3, 2, 2, H, 10};  // B, T, K, G, H, S
  const int64_t L = 2, layer = 1;
  auto fill = [&](int64_t n) {
    std::vector<float> v(n);
    for (auto& e : v) e = normal(rng) * 0.5f;
    return v;
  };
  std::vector<float> q = fill(d.B * d.T * d.K * d.G * H), cache_k = fill(L * d.B * d.S * d.K * H),
                     cache_v = fill(L * d.B * d.S * d.K * H), block_k = fill(d.B * d.T * d.K * H),
                     block_v = fill(d.B * d.T * d.K * H), out(q.size()), single(q.size());
  const std::vector<int32_t> positions = {6, 7, 8, 3, 4, 5}, from = {2, 0};
  const float* keys = cache_k.data() + layer * d.B * d.S * d.K * H;
  const float* values = cache_v.data() + layer * d.B * d.S * d.K * H;
  auto sees = [&](int64_t t, int64_t u) { return tree ? u == 0 || u == t : u <= t; };
  std::vector<uint8_t> mask(d.B * d.T * d.T);
  for (int64_t i = 0; i < d.B * d.T * d.T; ++i) mask[i] = sees(i / d.T % d.T, i % d.T);
  const uint8_t* block_mask = tree ? mask.data() : nullptr;
  const std::string what = "attention H=" + std::to_string(H) + (tree ? " tree" : "");
  std::vector<float> scores;
  std::vector<int64_t> seen;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t k = 0; k < d.K; ++k)
      attention::attend_pair(q.data(), keys, values, block_k.data(), block_v.data(), positions.data(), from[b],
                             block_mask, d, b, k, out.data(), scores, seen);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t k = 0; k < d.K; ++k)
        for (int64_t g = 0; g < d.G; ++g) {
          const float* query = q.data() + (((b * d.T + t) * d.K + k) * d.G + g) * H;
          std::vector<const float*> ks, vs;
          for (int64_t s = from[b]; s < positions[b * d.T]; ++s) {
            ks.push_back(keys + ((b * d.S + s) * d.K + k) * H);
            vs.push_back(values + ((b * d.S + s) * d.K + k) * H);
          }
          for (int64_t j = 0; j < d.T; ++j) {
            if (!sees(t, j)) continue;
            ks.push_back(block_k.data() + ((b * d.T + j) * d.K + k) * H);
            vs.push_back(block_v.data() + ((b * d.T + j) * d.K + k) * H);
          }
          std::vector<double> s(ks.size());
          double largest = -1e300, total = 0.0;
          for (size_t j = 0; j < ks.size(); ++j) {
            s[j] = 0.0;
            for (int64_t h = 0; h < H; ++h) s[j] += static_cast<double>(query[h]) * ks[j][h];
            largest = std::max(largest, s[j]);
          }
          for (auto& e : s) total += (e = std::exp(e - largest));
          for (int64_t h = 0; h < H; ++h) {
            double want = 0.0;
            for (size_t j = 0; j < ks.size(); ++j) want += s[j] / total * vs[j][h];
            const double got = out[(((b * d.T + t) * d.K + k) * d.G + g) * H + h];
            expect(std::fabs(got - want) <= 1e-5, what + " query " + std::to_string(b) + "," + std::to_string(t));
          }
        }
  attention::Shapes one = d;  // a block of one entry: its query's bits are those of the first query of three
  one.T = 1;
  std::vector<float> q1, bk1, bv1, out1(d.B * d.K * d.G * H);
  std::vector<int32_t> p1;
  for (int64_t b = 0; b < d.B; ++b) {
    q1.insert(q1.end(), q.begin() + b * d.T * d.K * d.G * H, q.begin() + (b * d.T + 1) * d.K * d.G * H);
    bk1.insert(bk1.end(), block_k.begin() + b * d.T * d.K * H, block_k.begin() + (b * d.T + 1) * d.K * H);
    bv1.insert(bv1.end(), block_v.begin() + b * d.T * d.K * H, block_v.begin() + (b * d.T + 1) * d.K * H);
    p1.push_back(positions[b * d.T]);
  }
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t k = 0; k < d.K; ++k)
      attention::attend_pair(q1.data(), keys, values, bk1.data(), bv1.data(), p1.data(), from[b], nullptr, one, b,
                             k, out1.data(), scores, seen);
  for (int64_t b = 0; b < d.B; ++b)
    expect(std::memcmp(out1.data() + b * d.K * d.G * H, out.data() + b * d.T * d.K * d.G * H,
                       d.K * d.G * H * sizeof(float)) == 0,
           what + ": row " + std::to_string(b) + "'s first query alone");
  // a bfloat16 cache: the bits of a float32 cache holding the same values (widening is exact)
  auto halve = [](std::vector<float>& v) {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = to_float(h[i] = to_bf16(v[i]));
    return h;
  };
  std::vector<float> fk = cache_k, fv = cache_v, fbk = block_k, fbv = block_v, out_f(q.size()), out_h(q.size());
  const std::vector<uint16_t> hk = halve(fk), hv = halve(fv), hbk = halve(fbk), hbv = halve(fbv);
  const int64_t at = layer * d.B * d.S * d.K * H;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t k = 0; k < d.K; ++k) {
      attention::attend_pair(q.data(), fk.data() + at, fv.data() + at, fbk.data(), fbv.data(), positions.data(),
                             from[b], block_mask, d, b, k, out_f.data(), scores, seen);
      attention::attend_pair(q.data(), hk.data() + at, hv.data() + at, hbk.data(), hbv.data(), positions.data(),
                             from[b], block_mask, d, b, k, out_h.data(), scores, seen);
    }
  expect(std::memcmp(out_f.data(), out_h.data(), q.size() * sizeof(float)) == 0,
         what + ": a bfloat16 cache as the float32 cache of its values");
  if (!tree) return;
  // the last node's bits: those of a causal block of its path (the root, then itself) at the same positions
  attention::Shapes two = d;
  two.T = 2;
  const int64_t per_query = d.K * d.G * H, per_entry = d.K * H;
  std::vector<float> q2, bk2, bv2, out2(d.B * 2 * per_query);
  std::vector<int32_t> p2;
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t j : {int64_t{0}, d.T - 1}) {
      q2.insert(q2.end(), q.begin() + (b * d.T + j) * per_query, q.begin() + (b * d.T + j + 1) * per_query);
      bk2.insert(bk2.end(), block_k.begin() + (b * d.T + j) * per_entry, block_k.begin() + (b * d.T + j + 1) * per_entry);
      bv2.insert(bv2.end(), block_v.begin() + (b * d.T + j) * per_entry, block_v.begin() + (b * d.T + j + 1) * per_entry);
      p2.push_back(positions[b * d.T] + (j > 0));
    }
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t k = 0; k < d.K; ++k)
      attention::attend_pair(q2.data(), keys, values, bk2.data(), bv2.data(), p2.data(), from[b], nullptr, two, b,
                             k, out2.data(), scores, seen);
  for (int64_t b = 0; b < d.B; ++b)
    expect(std::memcmp(out2.data() + (b * 2 + 1) * per_query, out.data() + (b * d.T + d.T - 1) * per_query,
                       per_query * sizeof(float)) == 0,
           what + ": row " + std::to_string(b) + "'s last node as the end of a causal block of its path");
}

}  // namespace

// attention::exp_lanes against exp in double: within 3 float ulps over [-87, 0], where a value lies in the vector
// not changing its bits, and at most e^-87 below.
void check_exp() {
  std::vector<float> xs;
  for (float x = 0.0f; x > -87.0f; x -= 0.0137f) xs.push_back(x);
  for (float x : {-0.0f, -1e-30f, -1e-7f, -0.34657f, -0.34658f, -86.99f, -87.0f}) xs.push_back(x);
  float worst = 0.0f;
  bool moved = false;
  for (size_t i = 0; i < xs.size(); i += kLanes) {
    Vec x, reversed;
    for (int l = 0; l < kLanes; ++l) x[l] = xs[std::min(i + l, xs.size() - 1)], reversed[kLanes - 1 - l] = x[l];
    const Vec got = attention::exp_lanes(x), back = attention::exp_lanes(reversed);
    for (int l = 0; l < kLanes; ++l) {
      const double want = std::exp(static_cast<double>(x[l]));
      worst = std::max(worst, static_cast<float>(std::fabs(got[l] - want) / want));
      moved |= std::memcmp(&got[l], &back[kLanes - 1 - l], sizeof(float)) != 0;
    }
  }
  expect(worst <= 3.0f * 1.1920929e-7f, "exp_lanes within 3 ulps (worst " + std::to_string(worst) + ")");
  expect(!moved, "exp_lanes: a value's bits whatever its lane");
  Vec below = Vec{} - 200.0f;
  expect(attention::exp_lanes(below)[0] <= 1.7e-38f, "exp_lanes below -87");
}

int main() {
  std::printf("isa %s\n", kIsa);
  uint32_t seed = 1;
  for (bool transposed : {false, true}) {
    const std::string layout = transposed ? " [N, K]" : " [K, N]";
    const Case plain{"", 200, 300, 1, transposed, false, false, false};  // a partial vector at the end of K
    Case c = plain;
    c.name = "float32" + layout;
    check_product<float, float>(c, seed++);
    check_product<uint16_t, float>(c, seed++);
    c.name = "bfloat16" + layout;
    check_product<float, uint16_t>(c, seed++);
    check_product<uint16_t, uint16_t>(c, seed++);
    c.name = "int8 per channel" + layout;
    check_product<float, int8_t>(c, seed++);
    check_product<uint16_t, int8_t>(c, seed++);
    c = {"int8 blocks of 32 (Q8_0)" + layout, 192, 300, 6, transposed, true, false, false};
    check_product<float, int8_t>(c, seed++);
    check_product<uint16_t, int8_t>(c, seed++);
  }
  Case c{"4-bit blocks of 32 (Q4_1)", 192, 300, 6, false, true, true, false};
  check_product<float, U4>(c, seed++);
  check_product<uint16_t, U4>(c, seed++);
  c = {"4-bit by int8 rows", 192, 320, 6, false, true, true, true};
  check_product<float, U4>(c, seed++);
  check_product<uint16_t, U4>(c, seed++);
  c.name = "4-bit by int8 rows, the largest sums";
  c.extreme = true;
  check_product<float, U4>(c, seed++);
  c.name = "4-bit by int8 rows in tile order, the largest sums";
  c.tiled = true;
  check_product<float, U4>(c, seed++);
  c = {"4-bit by int8 rows in tile order", 192, 320, 6, false, true, true, true};
  c.tiled = true;
  check_product<float, U4>(c, seed++);
  check_product<uint16_t, U4>(c, seed++);
  c = {"int8 blocks of 32 (Q8_0) by int8 rows", 192, 320, 6, false, true, false, true};
  check_product<float, int8_t>(c, seed++);
  check_product<uint16_t, int8_t>(c, seed++);
  c.name = "int8 blocks of 32 (Q8_0) by int8 rows in tile order";
  c.tiled = true;
  check_product<float, int8_t>(c, seed++);
  check_product<uint16_t, int8_t>(c, seed++);
  c = {"int8 blocks of 32 (Q8_0) [N, K] by int8 rows", 192, 300, 6, true, true, false, true};
  check_product<float, int8_t>(c, seed++);
  check_product<uint16_t, int8_t>(c, seed++);
  c = {"int8 blocks of 64 [N, K] by int8 rows", 192, 300, 3, true, true, false, true};
  check_product<float, int8_t>(c, seed++);
  for (int64_t H : {8, 20, 32, 64, 128})
    for (bool tree : {false, true}) check_attention(H, seed++, tree);
  check_halves();
  check_exp();
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
