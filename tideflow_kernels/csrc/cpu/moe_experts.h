// MoE experts: counting-sort the (token, slot) pairs by expert, then per expert group run the
// SwiGLU MLP and scatter the weighted result into an fp32 accumulator. Groups up to
// fused_group_max<T>() tokens (decode, small prefills) use register-tiled dot products that stream each
// weight row once for the whole group; larger groups (prefill) call at::mm on the gathered rows. On a
// host with AMX, bf16 groups of the sizes amx_takes() run on AMX tiles instead, in one parallel region
// for all of them (experts_amx). Weights in the tiled layout (`tiled`, tideflow_kernels/tiles.py) run every
// group on tiles: bf16 on the AMX tiles (amx_tiles.h), fp32 on the outer products of f32_tiles.h; where
// this build or host cannot run them they are read through a row-major copy.
#pragma once
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "common.h"
#include "f32_tiles.h"
#include "tile_dot.h"

namespace tideflow {

// Where at::mm on gathered rows overtakes the tiled loops, per dtype. Without AMX the tiled loops win
// up to ~96 tokens per expert in both dtypes (2-core AVX512-BF16 host). With AMX, at::mm runs bf16 on
// oneDNN's AMX brgemm, for the shapes the AMX tiles below do not take: builds with this limit at 2, 4,
// 8, 16 and off, timed on 1-512 tokens routed top-2 of 8 experts (hidden 512, 2-core AMX host), put
// the crossover at 10-16 tokens per expert: 12.
#ifndef TIDEFLOW_AMX_BF16_GROUP_MIN
#define TIDEFLOW_AMX_BF16_GROUP_MIN 12
#endif
template <typename T>
constexpr int64_t fused_group_max() {
#if defined(__AMX_BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) return TIDEFLOW_AMX_BF16_GROUP_MIN - 1;
#endif
  return 64;
}

// One expert, n <= fused_group_max<T>() tokens: act = silu(x W_gate^T) * (x W_up^T) (rounded to T as
// the reference does), out += w * act W2^T. Threads split the weight rows, so the expert's weights
// are read once per step whatever n is. TT tokens a tile: with 8, a tile holds 2 weight rows (1 gate and
// its up row; 2 rows of W2), so a group of 5-8 tokens reads each row in one pass instead of two; with 4,
// 4 rows a tile load fewer vectors per product for the small groups.
template <typename T, int TT>
void expert_fused_tiles(const T* x, const T* w13, const T* w2, const int64_t* toks, const float* gate_w,
                        int64_t n, int64_t hidden, int64_t inter, T* act, float* out) {
  constexpr int kRows = 16 / TT, kPairs = kRows / 2;  // weight rows a tile; gate (and up) rows a tile
  const bool par = n * hidden * inter >= kParallelGrain;
#pragma omp parallel for schedule(static) if (par)
  for (int64_t j = 0; j < inter; j += kPairs) {  // rows gate_j.., up_j.. (the last tile repeats its last row)
    const T* w[kRows];
    for (int q = 0; q < kPairs; ++q) {
      const int64_t jq = std::min(j + q, inter - 1);
      w[q] = w13 + jq * hidden;
      w[kPairs + q] = w13 + (inter + jq) * hidden;
    }
    const int pairs = int(std::min<int64_t>(kPairs, inter - j));
    for (int64_t t0 = 0; t0 < n; t0 += TT) {
      const int nt = int(std::min<int64_t>(TT, n - t0));
      const T* xs[TT];
      for (int t = 0; t < nt; ++t) xs[t] = x + toks[t0 + t] * hidden;
      alignas(64) float r[kRows][TT];
      tile_dot<kRows, TT>(w, xs, nt, hidden, r);
      for (int q = 0; q < pairs; ++q) {
#if defined(__AVX512F__)
        // the tile's tokens in one vector: one vector exp a row pair, not one scalar exp a token
        const __mmask16 live = __mmask16((1u << nt) - 1);
        alignas(64) float a[16];
        _mm512_store_ps(a, silu_mul16(_mm512_maskz_loadu_ps(live, r[q]), _mm512_maskz_loadu_ps(live, r[kPairs + q])));
        for (int t = 0; t < nt; ++t) act[(t0 + t) * inter + j + q] = from_f<T>(a[t]);
#else
        for (int t = 0; t < nt; ++t) act[(t0 + t) * inter + j + q] = from_f<T>(silu(r[q][t]) * r[kPairs + q][t]);
#endif
      }
    }
  }
#pragma omp parallel for schedule(static) if (par)
  for (int64_t j = 0; j < hidden; j += kRows) {  // rows j.. of W2 (the last tile repeats its last row)
    const T* w[kRows];
    for (int q = 0; q < kRows; ++q) w[q] = w2 + std::min(j + q, hidden - 1) * inter;
    const int rows = int(std::min<int64_t>(kRows, hidden - j));
    for (int64_t t0 = 0; t0 < n; t0 += TT) {
      const int nt = int(std::min<int64_t>(TT, n - t0));
      const T* xs[TT];
      for (int t = 0; t < nt; ++t) xs[t] = act + (t0 + t) * inter;
      float r[kRows][TT];
      tile_dot<kRows, TT>(w, xs, nt, inter, r);
      for (int t = 0; t < nt; ++t) {
        float* o = out + toks[t0 + t] * hidden + j;
        for (int q = 0; q < rows; ++q) o[q] += gate_w[t0 + t] * r[q][t];
      }
    }
  }
}

template <typename T>
void expert_fused(const T* x, const T* w13, const T* w2, const int64_t* toks, const float* gate_w,
                  int64_t n, int64_t hidden, int64_t inter, T* act, float* out) {
  if (n > kTileTokens)
    expert_fused_tiles<T, 8>(x, w13, w2, toks, gate_w, n, hidden, inter, act, out);
  else
    expert_fused_tiles<T, 4>(x, w13, w2, toks, gate_w, n, hidden, inter, act, out);
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// Which bf16 groups the AMX tiles take, in tokens per expert. Timed on one MoE call with every token
// routed to the same 2 experts (hidden 512, inter 1024, 2-core AMX host): the dot-product loops take
// 133 us at 1 token, 230 at 2, 281 at 3 and 475 at 8; the tiles ~236 us from 3 to 16 tokens (streaming
// the weights bounds them); at::mm (oneDNN's AMX brgemm) takes 972 us at 32 tokens against the tiles'
// 342, 2020 against 922 at 128 and 11062 against 6724 at 1024, so the tiles take every group from 3.
#ifndef TIDEFLOW_AMX_TILE_MIN
#define TIDEFLOW_AMX_TILE_MIN 3
#endif
inline bool amx_takes(int64_t n) { return n >= TIDEFLOW_AMX_TILE_MIN; }

// The tile loops' shapes: both products' K a multiple of 32, w13's gate and up rows in blocks of 32,
// w2's rows in blocks of 64.
inline bool amx_fits(int64_t hidden, int64_t inter) {
  return hidden % 64 == 0 && inter % 32 == 0 && amx::available();
}

// silu(g) * u for 16 tokens, rounded to bf16 (nearest even, as the reference rounds).
inline __m512i swiglu_bf16(const float* g, const float* u) {
  const __m512 a = silu_mul16(_mm512_loadu_ps(g), _mm512_loadu_ps(u));
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
}

// 16 tokens of one expert's group: the unit of work of the tile path (fewer are padded with zero tokens:
// a tile product costs the same for 16 columns as for 3, and the epilogues then work on whole vectors).
struct AmxChunk {
  int64_t expert;
  const int64_t* toks;  // the chunk's token rows
  const float* gate_w;  // their routing weights
  int nt;
};

// The chunks of one call that the tiles take, at most this many per parallel region (their packed tokens
// and activations take (hidden + inter) * 64 bytes per chunk: 96 KB at hidden 512, inter 1024).
constexpr size_t kAmxChunksPerRegion = 64;

// Every bf16 group the tiles take, in one parallel region per kAmxChunksPerRegion chunks, not one per
// expert: the threads meet at two barriers per region instead of two per expert, so the weight streams
// of consecutive experts run back to back. act = silu(x W_gate^T) * (x W_up^T), rounded to bf16 as the
// reference does and written straight into the packed (B) layout of the second product, then
// out += w * act W2^T.
// - packing: the chunks' tokens into the B layout, split over the threads;
// - gate/up: (expert, 32 gate rows, chunk) items, chunks innermost so an expert's weight rows are reused
//   hot by each of its chunks;
// - down: the threads split the output columns (64 at a time), each going over every chunk, so a token
//   routed to several experts has each of its columns written by one thread only.
// Both product loops hand out their items dynamically: a served engine shares its cores with the HTTP
// loop and the clients, and with a static split a thread that the OS preempts holds up the other at the
// barrier; dynamically the running thread takes over its items.
template <amx::Layout L>
void experts_amx(const uint16_t* x, const uint16_t* w13, const uint16_t* w2,
                        const std::vector<AmxChunk>& all, int64_t hidden, int64_t inter, float* out) {
  constexpr int kCols = amx::kTokens;
  const int64_t x_size = hidden / 2 * kCols, act_size = inter / 2 * kCols;
  const int64_t col_blocks = hidden / 64;
  std::vector<uint32_t> x_packed, act_packed;
  std::vector<std::pair<int64_t, int64_t>> items;
  const __m512i column = _mm512_mullo_epi32(  // offsets of one column of a C tile, 16 rows apart
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(kCols));
  for (size_t first = 0; first < all.size(); first += kAmxChunksPerRegion) {
    const int64_t count = int64_t(std::min(kAmxChunksPerRegion, all.size() - first));
    const AmxChunk* chunks = all.data() + first;
    x_packed.resize(count * x_size);
    act_packed.resize(count * act_size);
    int64_t tokens = 0;
    for (int64_t c = 0; c < count; ++c) tokens += chunks[c].nt;
    items.clear();  // (chunk, first gate row) of the gate/up phase: per expert, per 32 rows, per chunk
    for (int64_t c0 = 0; c0 < count;) {
      int64_t c1 = c0 + 1;
      while (c1 < count && chunks[c1].expert == chunks[c0].expert) ++c1;
      for (int64_t j = 0; j < inter; j += 32)
        for (int64_t c = c0; c < c1; ++c) items.push_back({c, j});
      c0 = c1;
    }
#pragma omp parallel if (tokens * hidden * inter >= kParallelGrain)
    {
#pragma omp for schedule(static)
      for (int64_t c = 0; c < count; ++c) {
        const uint16_t* rows[kCols];
        for (int t = 0; t < chunks[c].nt; ++t) rows[t] = x + chunks[c].toks[t] * hidden;
        amx::pack_tokens(rows, chunks[c].nt, hidden, x_packed.data() + c * x_size);
      }  // barrier: every chunk is packed
      amx::configure();
      alignas(64) float tile[4 * amx::kTileRows * kCols];
#pragma omp for schedule(dynamic, 4)
      for (size_t i = 0; i < items.size(); ++i) {
        const auto [c, j] = items[i];
        const uint16_t* we = w13 + chunks[c].expert * 2 * inter * hidden;
        const uint16_t* blocks[4] = {amx::block_at(we, j, hidden), amx::block_at(we, j + 16, hidden),
                                     amx::block_at(we, inter + j, hidden), amx::block_at(we, inter + j + 16, hidden)};
        amx::rows_by_tokens<L>(blocks, x_packed.data() + c * x_size, hidden, tile);
        uint32_t* act = act_packed.data() + c * act_size + (j / 2) * kCols;  // rows j+2m, j+2m+1: pair m
        for (int m = 0; m < 16; ++m) {
          const __m512i lo = swiglu_bf16(tile + 2 * m * kCols, tile + (32 + 2 * m) * kCols);
          const __m512i hi = swiglu_bf16(tile + (2 * m + 1) * kCols, tile + (33 + 2 * m) * kCols);
          _mm512_storeu_si512(act + m * kCols, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
      }  // the loop's barrier: every act is written before any thread reads it below
#pragma omp for schedule(dynamic, 1)
      for (int64_t hb = 0; hb < col_blocks; ++hb) {
        const int64_t h = hb * 64;
        for (int64_t c = 0; c < count; ++c) {
          const uint16_t* we = w2 + chunks[c].expert * hidden * inter;
          const uint16_t* blocks[4] = {amx::block_at(we, h, inter), amx::block_at(we, h + 16, inter),
                                       amx::block_at(we, h + 32, inter), amx::block_at(we, h + 48, inter)};
          amx::rows_by_tokens<L>(blocks, act_packed.data() + c * act_size, inter, tile);
          for (int t = 0; t < chunks[c].nt; ++t) {  // token t's 64 outputs: column t of the tiles, 16 rows a gather
            float* o = out + chunks[c].toks[t] * hidden + h;
            const __m512 w = _mm512_set1_ps(chunks[c].gate_w[t]);
            for (int q = 0; q < 4; ++q) {
              const __m512 y = _mm512_i32gather_ps(column, tile + q * 16 * kCols + t, 4);
              _mm512_storeu_ps(o + 16 * q, _mm512_fmadd_ps(w, y, _mm512_loadu_ps(o + 16 * q)));
            }
          }
        }
      }
      amx::release();
    }
  }
}
#endif

// One expert, large group: gathered rows through at::mm in the input dtype (as the reference).
template <typename T>
void expert_mm(const at::Tensor& x, const at::Tensor& w13e, const at::Tensor& w2e,
               const std::vector<int64_t>& toks, const std::vector<float>& gate_w, int64_t inter,
               float* out) {
  const int64_t n = int64_t(toks.size()), hidden = x.size(1);
  auto idx = at::from_blob(const_cast<int64_t*>(toks.data()), {n}, at::kLong);
  auto h = at::mm(x.index_select(0, idx), w13e.t());
  auto act = at::empty({n, inter}, x.options());
  const T* hp = cptr<T>(h);
  T* ap = mptr<T>(act);
#pragma omp parallel for schedule(static) if (n * inter >= kParallelGrain)
  for (int64_t a = 0; a < n; ++a)
#pragma omp simd
    for (int64_t j = 0; j < inter; ++j)
      ap[a * inter + j] = from_f<T>(silu(to_f(hp[a * 2 * inter + j])) * to_f(hp[a * 2 * inter + inter + j]));
  auto y = at::mm(act, w2e.t()).contiguous();
  const T* yp = cptr<T>(y);
#pragma omp parallel for schedule(static) if (n * hidden >= kParallelGrain)
  for (int64_t j0 = 0; j0 < hidden; j0 += 256) {  // column tiles: tokens may repeat across slots
    const int64_t j1 = std::min(hidden, j0 + 256);
    for (int64_t a = 0; a < n; ++a) {
      float* o = out + toks[a] * hidden;
      const T* ya = yp + a * hidden;
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) o[j] += gate_w[a] * to_f(ya[j]);
    }
  }
}

// Whether experts of these sizes and dtype run on tiles in this build and on this host, so that the tiled
// layout is the one to keep them in: bf16 on the AMX tiles, fp32 on the outer products of f32_tiles.h.
inline bool moe_tiles_fit(int64_t hidden, int64_t inter, bool bf16) {
  if (bf16) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    return amx_fits(hidden, inter);
#else
    return false;
#endif
  }
#if defined(__AVX512F__)
  return hidden % f32tiles::kRows == 0 && inter % f32tiles::kRows == 0;
#else
  return false;
#endif
}

// Elements of one tile row in the tiled layout: 32 bf16 (an AMX tile row), 1 fp32 (tideflow_kernels/tiles.py).
inline int64_t tile_cols(at::ScalarType dtype) { return dtype == at::kFloat ? 1 : 32; }

// [E, R, K] in the tiled layout ([E][R/16][K/c][16][c], c = tile_cols) -> the same weights row-major.
inline at::Tensor untile(const at::Tensor& w) {
  const int64_t E = w.size(0), R = w.size(1), K = w.size(2), c = tile_cols(w.scalar_type());
  return w.view({E, R / 16, K / c, 16, c}).permute({0, 1, 3, 2, 4}).reshape({E, R, K});
}

inline at::Tensor moe_experts(const at::Tensor& x_in, const at::Tensor& w13_in,
                              const at::Tensor& w2_in, const at::Tensor& topk_weights,
                              const at::Tensor& topk_ids, bool tiled) {
  TORCH_CHECK(x_in.dim() == 2 && w13_in.dim() == 3 && w2_in.dim() == 3,
              "moe_experts: expected x [T, H], w13 [E, 2I, H], w2 [E, H, I]");
  auto x = x_in.contiguous();
  auto w13 = w13_in.contiguous();
  auto w2 = w2_in.contiguous();
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = w13.size(0);
  const int64_t inter = w2.size(2), k = topk_ids.size(1);
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == hidden && w2.size(1) == hidden,
              "moe_experts: weight shapes w13 ", w13.sizes(), " w2 ", w2.sizes(),
              " do not match hidden ", hidden);
  TORCH_CHECK(x.scalar_type() == w13.scalar_type() && x.scalar_type() == w2.scalar_type(),
              "moe_experts: x and weights must share a dtype");
  const int64_t cols = tile_cols(x.scalar_type());
  TORCH_CHECK(!tiled || (hidden % 16 == 0 && inter % 16 == 0 && hidden % cols == 0 && inter % cols == 0),
              "moe_experts: tiled ", x.scalar_type(), " weights need hidden and inter multiples of ", std::max<int64_t>(16, cols),
              ", got ", hidden, ", ", inter);
  const bool tiles_run = tiled && moe_tiles_fit(hidden, inter, x.scalar_type() == at::kBFloat16);  // read as they are
  if (tiled && !tiles_run) {
    w13 = untile(w13);
    w2 = untile(w2);
  }
  auto ids = topk_ids.to(at::kLong).contiguous();
  auto tw = topk_weights.to(at::kFloat).contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const float* twp = tw.data_ptr<float>();

  // Counting sort of the valid (token, slot) pairs by expert; ids < 0 live on another rank.
  std::vector<int64_t> offsets(experts + 1, 0);
  for (int64_t a = 0; a < tokens * k; ++a) {
    TORCH_CHECK(idp[a] < experts, "moe_experts: expert id ", idp[a], " >= ", experts);
    if (idp[a] >= 0) ++offsets[idp[a] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
  std::vector<int64_t> sorted_tok(offsets[experts]);
  std::vector<float> sorted_w(offsets[experts]);
  for (int64_t a = 0; a < tokens * k; ++a) {
    if (idp[a] < 0) continue;
    const int64_t slot = cursor[idp[a]]++;
    sorted_tok[slot] = a / k;
    sorted_w[slot] = twp[a];
  }

  auto acc = at::zeros({tokens, hidden}, x.options().dtype(at::kFloat));
  float* out = acc.data_ptr<float>();
  dispatch(x, "moe_experts", [&](auto tag) {
    using T = decltype(tag);
    std::vector<T> act(std::min(fused_group_max<T>(), tokens) * inter);
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    const bool amx_ok = std::is_same_v<T, uint16_t> && amx_fits(hidden, inter);  // tiles_run implies it
    std::vector<AmxChunk> amx_chunks;  // the groups the tiles take, cut in 16-token chunks, expert by expert
#endif
#if defined(__AVX512F__)
    std::vector<f32tiles::Tile> f32_tiles;  // fp32 groups cut in register tiles of nearly equal size
#endif
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t n = offsets[e + 1] - offsets[e];
      if (n == 0) continue;
      const int64_t s = offsets[e];
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (amx_ok && (tiles_run || amx_takes(n))) {
          for (int64_t t0 = 0; t0 < n; t0 += amx::kTokens)
            amx_chunks.push_back({e, sorted_tok.data() + s + t0, sorted_w.data() + s + t0,
                                  int(std::min<int64_t>(amx::kTokens, n - t0))});
          continue;
        }
      }
#endif
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) {
        if (tiles_run) {
          const int64_t parts = (n + f32tiles::kTokens - 1) / f32tiles::kTokens;
          for (int64_t p = 0, t0 = 0; p < parts; ++p) {
            const int64_t nt = n / parts + (p < n % parts ? 1 : 0);
            f32_tiles.push_back({e, sorted_tok.data() + s + t0, sorted_w.data() + s + t0, int(nt)});
            t0 += nt;
          }
          continue;
        }
      }
#endif
      if (n <= fused_group_max<T>()) {
        expert_fused<T>(cptr<T>(x), cptr<T>(w13) + e * 2 * inter * hidden,
                           cptr<T>(w2) + e * hidden * inter, sorted_tok.data() + s,
                           sorted_w.data() + s, n, hidden, inter, act.data(), out);
      } else {
        std::vector<int64_t> toks(sorted_tok.begin() + s, sorted_tok.begin() + s + n);
        std::vector<float> gw(sorted_w.begin() + s, sorted_w.begin() + s + n);
        expert_mm<T>(x, w13[e], w2[e], toks, gw, inter, out);
      }
    }
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) f32tiles::experts(cptr<T>(x), cptr<T>(w13), cptr<T>(w2), f32_tiles, hidden, inter, out);
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (!amx_chunks.empty()) {
        if (tiles_run)
          experts_amx<amx::Layout::kTiled>(cptr<T>(x), cptr<T>(w13), cptr<T>(w2), amx_chunks, hidden, inter, out);
        else
          experts_amx<amx::Layout::kRows>(cptr<T>(x), cptr<T>(w13), cptr<T>(w2), amx_chunks, hidden, inter, out);
      }
    }
#endif
  });
  return x.scalar_type() == at::kFloat ? acc : acc.to(x.scalar_type());
}

}  // namespace tideflow
