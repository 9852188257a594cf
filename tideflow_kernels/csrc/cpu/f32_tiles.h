// fp32 experts on weights in the fp32 tiled layout (tideflow_kernels/tiles.py): each block of 16 weight
// rows stored k by k ([R/16][K][16]), so at every k the block's 16 weights are one vector. The product is
// then an outer product: a token's x[k] broadcast times that vector, summed over k, with two blocks
// (a gate block and its up block; or 32 output columns of W2) against up to kTokens tokens held in
// 2 x kTokens accumulator registers. Each k costs 2 vector loads and kTokens broadcasts for 2 x kTokens
// FMAs, the accumulators need no horizontal sums, and a block streams through memory front to back.
// The row-major dot products (tile_dot.h) instead take their tokens' rows from L1 on every weight row:
// from 8 tokens on, at hidden 512 fp32, those rows no longer fit and the products wait on L2, and a
// decode step's weights arrive as two or four row streams per thread instead of one.
#pragma once
#if defined(__AVX512F__)
#include <vector>

#include "common.h"

namespace tideflow {
namespace f32tiles {

constexpr int kRows = 16;    // weight rows a block (one vector of fp32)
constexpr int kTokens = 12;  // tokens a register tile: 2 x 12 accumulators, 2 weight vectors, 1 broadcast

// How many k steps (cache lines of each block) ahead the blocks are asked for. The hardware prefetcher stops
// at every 4 KB page boundary, which a block crosses every 64 k steps. Timed over 8 layers of 8 experts
// (hidden 512, inter 1024, top-2, 2-core host), ms a layer at 8 / 32 / 128 tokens: none 1.63 / 2.14 / 4.20,
// 16 ahead 1.52 / 1.68 / 3.55, 48 ahead 1.41 / 1.59 / 3.41, 96 ahead 1.43 / 1.60 / 3.56, 192 ahead
// 1.49 / 1.63 / 3.68. (Prefetches past a block's end touch the next block or harmless memory: a prefetch
// never faults.)
constexpr int64_t kPrefetch = 48;

// acc[m][v] = sum_k a[k * kTokens + m] * block_v[k * kRows ..] for m < MT: the tokens' values come packed
// k-major (a[k][kTokens]), so each broadcast is one load at a fixed offset from one pointer. An FMA waits
// on the one before it into the same accumulator, so a few tokens alone would leave the FMA units idle:
// below 4 tokens, consecutive k steps go to KU separate partial sums (at least 8 chains in all), added at
// the end. K is a multiple of kRows, so of KU.
template <int MT>
inline void outer_products(const float* b0, const float* b1, const float* a, int64_t K, __m512 (&acc)[MT][2]) {
  constexpr int KU = MT >= 4 ? 1 : 4 / MT;
  __m512 part[KU][MT][2];
  for (int u = 0; u < KU; ++u)
    for (int m = 0; m < MT; ++m) part[u][m][0] = part[u][m][1] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += KU) {
    for (int u = 0; u < KU; ++u) {
      const int64_t k = k0 + u;
      _mm_prefetch(reinterpret_cast<const char*>(b0 + (k + kPrefetch) * kRows), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b1 + (k + kPrefetch) * kRows), _MM_HINT_T0);
      const __m512 w0 = _mm512_loadu_ps(b0 + k * kRows), w1 = _mm512_loadu_ps(b1 + k * kRows);
      const float* ak = a + k * kTokens;
      for (int m = 0; m < MT; ++m) {
        const __m512 v = _mm512_set1_ps(ak[m]);
        part[u][m][0] = _mm512_fmadd_ps(w0, v, part[u][m][0]);
        part[u][m][1] = _mm512_fmadd_ps(w1, v, part[u][m][1]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < 2; ++v) {
      acc[m][v] = part[0][m][v];
      for (int u = 1; u < KU; ++u) acc[m][v] = _mm512_add_ps(acc[m][v], part[u][m][v]);
    }
}

// One register tile of one expert's group: up to kTokens tokens, their rows and routing weights.
struct Tile {
  int64_t expert;
  const int64_t* toks;
  const float* gate_w;
  int nt;
};

// act[j + i] of the tile's token m, for the 16 gate/up rows j.. of block pair (gate j/16, up (inter+j)/16):
// silu(gate) * up, written k-major (act[k][kTokens]) as the second product reads it.
template <int MT>
inline void gate_up(const float* gate, const float* up, const float* xp, int64_t hidden, float* act) {
  __m512 acc[MT][2];
  outer_products<MT>(gate, up, xp, hidden, acc);
  alignas(64) float a[kRows];
  for (int m = 0; m < MT; ++m) {
    _mm512_store_ps(a, silu_mul16(acc[m][0], acc[m][1]));
    for (int i = 0; i < kRows; ++i) act[i * kTokens + m] = a[i];
  }
}

// out[tok_m][h..h + 16 * cols] += w_m * (act_m . W2 rows h..): two blocks of W2 (one when cols is 1).
template <int MT>
inline void down(const float* b0, const float* b1, int cols, const float* act, int64_t inter, const Tile& t,
                 int64_t hidden, int64_t h, float* out) {
  __m512 acc[MT][2];
  outer_products<MT>(b0, b1, act, inter, acc);
  for (int m = 0; m < MT; ++m) {
    float* o = out + t.toks[m] * hidden + h;
    const __m512 w = _mm512_set1_ps(t.gate_w[m]);
    for (int v = 0; v < cols; ++v)
      _mm512_storeu_ps(o + 16 * v, _mm512_fmadd_ps(w, acc[m][v], _mm512_loadu_ps(o + 16 * v)));
  }
}

// Calls f(std::integral_constant<int, MT>) for the tile's token count 1..kTokens.
template <typename F>
inline void with_tokens(int nt, F&& f) {
  switch (nt) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 9: return f(std::integral_constant<int, 9>{});
    case 10: return f(std::integral_constant<int, 10>{});
    case 11: return f(std::integral_constant<int, 11>{});
    default: return f(std::integral_constant<int, kTokens>{});
  }
}

// Every expert group of one call, in one parallel region (as experts_amx: two barriers a call, not two an
// expert). Items are handed out dynamically (a preempted thread's items go to the other):
// - packing: each tile's token rows k-major (x[k][kTokens]);
// - gate/up: (expert, 16-row block pair, tile), the tiles innermost so an expert's block is reused hot by
//   each of its tiles;
// - down: the threads split the output columns (32 at a time), each going over every tile, so a token
//   routed to several experts has each of its columns written by one thread only.
inline void experts(const float* x, const float* w13, const float* w2, const std::vector<Tile>& tiles,
                    int64_t hidden, int64_t inter, float* out) {
  const int64_t count = int64_t(tiles.size());
  if (count == 0) return;
  std::vector<float> xp(count * hidden * kTokens), act(count * inter * kTokens);
  std::vector<std::pair<int64_t, int64_t>> items;  // (tile, first gate row)
  int64_t tokens = 0;
  for (int64_t c0 = 0; c0 < count;) {
    int64_t c1 = c0 + 1;
    while (c1 < count && tiles[c1].expert == tiles[c0].expert) ++c1;
    for (int64_t j = 0; j < inter; j += kRows)
      for (int64_t c = c0; c < c1; ++c) items.push_back({c, j});
    c0 = c1;
  }
  for (const Tile& t : tiles) tokens += t.nt;
  const int64_t col_blocks = (hidden + 2 * kRows - 1) / (2 * kRows);
#pragma omp parallel if (tokens * hidden * inter >= kParallelGrain)
  {
#pragma omp for schedule(static)
    for (int64_t c = 0; c < count; ++c) {
      float* dst = xp.data() + c * hidden * kTokens;
      for (int m = 0; m < tiles[c].nt; ++m) {
        const float* row = x + tiles[c].toks[m] * hidden;
        for (int64_t k = 0; k < hidden; ++k) dst[k * kTokens + m] = row[k];
      }
    }  // barrier: every tile is packed
#pragma omp for schedule(dynamic, 4)
    for (size_t i = 0; i < items.size(); ++i) {
      const auto [c, j] = items[i];
      const float* we = w13 + tiles[c].expert * 2 * inter * hidden;
      const float* gate = we + j * hidden;  // block j/16 starts at row j: 16 rows of `hidden` floats
      const float* up = we + (inter + j) * hidden;
      const float* xt = xp.data() + c * hidden * kTokens;
      float* at = act.data() + c * inter * kTokens + j * kTokens;
      with_tokens(tiles[c].nt, [&](auto mt) { gate_up<decltype(mt)::value>(gate, up, xt, hidden, at); });
    }  // the loop's barrier: every act is written before any thread reads it below
#pragma omp for schedule(dynamic, 1)
    for (int64_t hb = 0; hb < col_blocks; ++hb) {
      const int64_t h = hb * 2 * kRows;
      const int cols = h + kRows < hidden ? 2 : 1;
      for (int64_t c = 0; c < count; ++c) {
        const float* we = w2 + tiles[c].expert * hidden * inter;
        const float* b0 = we + h * inter;
        const float* b1 = cols == 2 ? b0 + kRows * inter : b0;
        const float* at = act.data() + c * inter * kTokens;
        with_tokens(tiles[c].nt, [&](auto mt) { down<decltype(mt)::value>(b0, b1, cols, at, inter, tiles[c], hidden, h, out); });
      }
    }
  }
}

}  // namespace f32tiles
}  // namespace tideflow
#endif
