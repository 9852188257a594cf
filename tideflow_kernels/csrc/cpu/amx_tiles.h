// AMX tile products for bf16 weight rows against a few tokens (decode-sized expert groups).
//
// TDPBF16PS multiplies an A tile (16 rows x 32 bf16) by a B tile whose rows hold *pairs* of bf16 per
// column (the VNNI layout). The weights go in as A and the tokens as B. B's layout for a token is its
// row viewed as K/2 32-bit pairs, so packing the tokens is a 32-bit transpose of a few rows; the
// product C[row][token] comes out in fp32.
//
// The weights are read in one of two layouts (Layout): row-major [rows, K], a tile load taking 16 rows
// 2K bytes apart, or tiled ([rows/16][K/32][16][32], tideflow_kernels/tiles.py), each tile one
// contiguous 1 KB and a block of 16 rows one linear stream. Streaming weights is what bounds these
// products; on a 2-core AMX host a stand-alone loop over 8 layers of experts read 22-24 GB/s row-major
// and 30-31 GB/s tiled (software prefetch of the row-major rows did not close the gap: 20-26 GB/s).
//
// Linux grants a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM);
// available() asks once and says whether the tiles may be used. Each thread loads the tile
// configuration before its first tile instruction (configure) and releases it when done.
#pragma once
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace tideflow::amx {

constexpr int kTileRows = 16;  // weight rows per tile
constexpr int kTileK = 32;     // bf16 per tile row (64 bytes)
constexpr int kTokens = 16;    // tokens per B tile (16 columns of 4 bytes); fewer are padded with zeros

inline bool available() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 accumulate C (16 rows x 16 tokens fp32), 4 and 5 take weight rows in turn, 6 the tokens.
inline void configure() {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = uint16_t(t == 4 || t == 5 ? kTileK * 2 : kTokens * 4);
  }
  _tile_loadconfig(&cfg);
}

inline void release() { _tile_release(); }

// n <= kTokens token rows [K] bf16 (given by pointers) -> packed [K/2, kTokens] pairs, the B operand;
// columns past n are zero. K % 32 == 0.
inline void pack_tokens(const uint16_t* const* rows, int n, int64_t K, uint32_t* packed) {
  for (int64_t p = 0; p < K / 2; ++p) {
    uint32_t* dst = packed + p * kTokens;
    for (int t = 0; t < n; ++t) dst[t] = reinterpret_cast<const uint32_t*>(rows[t])[p];
    for (int t = n; t < kTokens; ++t) dst[t] = 0;
  }
}

enum class Layout { kRows, kTiled };

// Where the weight block starting at row r of a [rows, K] matrix begins: the same offset (r * K) in both
// layouts, since a tiled block of 16 rows holds K/32 tiles of 512 elements.
inline const uint16_t* block_at(const uint16_t* w, int64_t r, int64_t K) { return w + r * K; }

// c[b*16 + i][t] = dot(row i of block b, token t) for 4 blocks of 16 weight rows of a [rows, K] matrix
// in layout L (block_at) against the packed tokens; c is [64, kTokens] fp32. Needs configure() on this
// thread.
template <Layout L>
inline void rows_by_tokens(const uint16_t* const (&blocks)[4], const uint32_t* packed, int64_t K, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  // row-major: tile k starts k elements into the block, rows 2K bytes apart; tiled: 16 * k, rows 64 apart
  constexpr int64_t step = L == Layout::kTiled ? kTileRows : 1;
  const int64_t stride = L == Layout::kTiled ? kTileK * 2 : K * 2;
  for (int64_t k = 0; k < K; k += kTileK) {
    _tile_loadd(6, packed + (k / 2) * kTokens, kTokens * 4);
    _tile_loadd(4, blocks[0] + k * step, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, blocks[1] + k * step, stride);
    _tile_dpbf16ps(1, 5, 6);
    _tile_loadd(4, blocks[2] + k * step, stride);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(5, blocks[3] + k * step, stride);
    _tile_dpbf16ps(3, 5, 6);
  }
  _tile_stored(0, c, kTokens * 4);
  _tile_stored(1, c + 16 * kTokens, kTokens * 4);
  _tile_stored(2, c + 32 * kTokens, kTokens * 4);
  _tile_stored(3, c + 48 * kTokens, kTokens * 4);
}

}  // namespace tideflow::amx
#endif
