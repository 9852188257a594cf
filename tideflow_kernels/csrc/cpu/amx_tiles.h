// AMX tile products for bf16 weight rows against a few tokens (decode-sized expert groups).
//
// TDPBF16PS multiplies an A tile (16 rows x 32 bf16) by a B tile whose rows hold *pairs* of bf16 per
// column (the VNNI layout). The weights go in as A, read in place from their row-major [rows, K]
// storage (a tile load takes a row stride), and the tokens go in as B. B's layout for a token is its
// row viewed as K/2 32-bit pairs, so packing the tokens is a 32-bit transpose of a few rows: no copy
// of the weights is kept in another layout, and the product C[row][token] comes out in fp32.
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
constexpr int kMaxTokens = 16; // tokens per B tile (16 columns of 4 bytes)

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

// Tiles 0-3 accumulate C (16 rows x n tokens fp32), 4 and 5 take weight rows in turn, 6 the tokens.
inline void configure(int n) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = uint16_t(t == 4 || t == 5 ? kTileK * 2 : n * 4);
  }
  _tile_loadconfig(&cfg);
}

inline void release() { _tile_release(); }

// tokens [n, K] bf16 rows (given by pointers) -> packed [K/2, width] pairs, the B operand of `width`
// columns, those past n zero. K % 32 == 0.
inline void pack_tokens(const uint16_t* const* rows, int n, int width, int64_t K, uint32_t* packed) {
  for (int64_t p = 0; p < K / 2; ++p) {
    uint32_t* dst = packed + p * width;
    for (int t = 0; t < n; ++t) dst[t] = reinterpret_cast<const uint32_t*>(rows[t])[p];
    for (int t = n; t < width; ++t) dst[t] = 0;
  }
}

// c[b*16 + i][t] = dot(block_b row i, token t) for NB blocks of 16 weight rows (row stride ld
// elements), against the packed tokens; c is [NB*16, n] fp32. Needs configure(n) on this thread.
template <int NB>
inline void rows_by_tokens(const uint16_t* const (&blocks)[NB], int64_t ld, const uint32_t* packed, int n,
                           int64_t K, float* c) {
  static_assert(NB >= 1 && NB <= 4, "four accumulator tiles");
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  const int64_t stride = ld * 2;
  for (int64_t k = 0; k < K; k += kTileK) {
    _tile_loadd(6, packed + (k / 2) * n, n * 4);
    _tile_loadd(4, blocks[0] + k, stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) {
      _tile_loadd(5, blocks[1] + k, stride);
      _tile_dpbf16ps(1, 5, 6);
    }
    if constexpr (NB > 2) {
      _tile_loadd(4, blocks[2] + k, stride);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (NB > 3) {
      _tile_loadd(5, blocks[3] + k, stride);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  const int64_t cs = int64_t(n) * 4;
  _tile_stored(0, c, cs);
  if constexpr (NB > 1) _tile_stored(1, c + 16 * n, cs);
  if constexpr (NB > 2) _tile_stored(2, c + 32 * n, cs);
  if constexpr (NB > 3) _tile_stored(3, c + 48 * n, cs);
}

}  // namespace tideflow::amx
#endif
