// What the AMX kernels share (cpu_matmul.cc's int8 and float32 kernels, cpu_int8.cc's W8A8 one):
// whether this process may use the tiles, their configuration, the tile shapes the kernels use.
//
// Built with -DPATHSERVE_AMX_EMULATE (PATHSERVE_CPU_AMX=emulate, serving/kernels/library.py), the
// tile intrinsics the kernels call run in plain C++ instead (namespace amx_emulation below), and
// AMX counts as present on any CPU with the AVX-512 the kernels' other code needs. That is for tests only:
// the kernels' tile logic (configurations, strides, tails, the integer and bfloat16 arithmetic) is
// checked on every AVX-512 machine, where AMX hardware is rare; it says nothing of their speed.

#ifndef PATHSERVE_KERNELS_CPU_AMX_H_
#define PATHSERVE_KERNELS_CPU_AMX_H_

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define PATHSERVE_HAS_AMX 1  // the compiler has the AMX intrinsics
#define PATHSERVE_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8,amx-bf16")))
#else
#define PATHSERVE_HAS_AMX 0
#endif

namespace pathserve {

constexpr int kAmxInt8 = 25, kAmxBf16 = 22;  // CPUID leaf 7 EDX bits of AMX's int8 and bfloat16 multiplies
constexpr int64_t kAmxCols = 16;             // output columns per tile (an AMX C tile's width in int32)
constexpr int64_t kAmxDepth = 64;            // int8 inputs per tile multiply (an A tile row: 64 bytes)
constexpr int64_t kAmxRows = 16;             // rows of x per tile multiply

// The 64 bytes LDTILECFG reads (palette 1): each tile register's bytes per row and rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#if PATHSERVE_HAS_AMX && !defined(PATHSERVE_AMX_EMULATE)

// Whether Linux lets this process use AMX tiles (the tile data state must be asked for once per
// process) and the CPU has AMX with `feature` (CPUID leaf 7 EDX bit: 25 AMX-INT8, 22 AMX-BF16).
// Decided once: every kernel call asks, and CPUID traps to the hypervisor in a VM.
inline bool AmxReady(int feature) {
  static const unsigned features = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return 0u;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // arch_prctl: ARCH_REQ_XCOMP_PERM
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0 ? d : 0u;
  }();
  return features & (1u << feature);
}

#elif PATHSERVE_HAS_AMX  // emulated

// Emulated: present wherever the library loads (library.py takes the AMX kernels only where the
// kernels run on AVX-512).
inline bool AmxReady(int) { return true; }

// Eight tile registers per thread, as the hardware has, and the checks the hardware makes: a
// configuration it would refuse, a tile used unconfigured, or a multiply whose tiles' shapes do
// not fit one another (a fault on the hardware) abort the process with the reason.
namespace amx_emulation {

struct Tiles {
  bool configured = false;
  uint16_t colsb[8] = {};
  uint8_t rows[8] = {};
  alignas(64) uint8_t data[8][16][64] = {};
};

inline Tiles& State() {
  thread_local Tiles tiles;
  return tiles;
}

[[noreturn]] inline void Fault(const char* what, int tile) {
  std::fprintf(stderr, "emulated AMX: %s (tile %d)\n", what, tile);
  std::abort();
}

inline Tiles& Use(int tile) {
  Tiles& s = State();
  if (!s.configured) Fault("a tile instruction before LDTILECFG", tile);
  if (tile < 0 || tile > 7 || s.rows[tile] == 0) Fault("an unconfigured tile", tile);
  return s;
}

// LDTILECFG's checks: palette 1, start_row 0, reserved bytes and tiles 8-15 zero, shapes in range.
inline void LoadConfig(const void* config) {
  const auto* c = static_cast<const TileConfig*>(config);
  Tiles& s = State();
  if (c->palette != 1) Fault("palette other than 1", -1);
  if (c->start_row != 0) Fault("a start row other than 0", -1);
  for (uint8_t byte : c->reserved)
    if (byte) Fault("a reserved byte set", -1);
  for (int t = 8; t < 16; ++t)
    if (c->colsb[t] || c->rows[t]) Fault("a shape for a tile palette 1 lacks", t);
  for (int t = 0; t < 8; ++t) {
    if (c->colsb[t] > 64 || c->rows[t] > 16 || (c->colsb[t] == 0) != (c->rows[t] == 0)) Fault("a bad shape", t);
    s.colsb[t] = c->colsb[t];
    s.rows[t] = c->rows[t];
  }
  std::memset(s.data, 0, sizeof(s.data));
  s.configured = true;
}

inline void Release() { State().configured = false; }

inline void Zero(int tile) { std::memset(Use(tile).data[tile], 0, sizeof(Tiles::data[0])); }

// Rows and bytes past the configured ones read as zeros (as TILELOADD leaves them).
inline void Load(int tile, const void* base, int64_t stride) {
  Tiles& s = Use(tile);
  std::memset(s.data[tile], 0, sizeof(Tiles::data[0]));
  for (int r = 0; r < s.rows[tile]; ++r)
    std::memcpy(s.data[tile][r], static_cast<const uint8_t*>(base) + r * stride, s.colsb[tile]);
}

inline void Store(int tile, void* base, int64_t stride) {
  Tiles& s = Use(tile);
  for (int r = 0; r < s.rows[tile]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[tile][r], s.colsb[tile]);
}

// Three different tiles; C's rows and A's, A's 4-byte groups and B's rows, C's columns and B's
// must match.
inline Tiles& Multiply(int c, int a, int b) {
  Tiles& s = Use(c);
  Use(a);
  Use(b);
  if (c == a || c == b || a == b) Fault("a multiply naming one tile twice", c);
  if (s.rows[c] != s.rows[a] || s.colsb[a] != 4 * s.rows[b] || s.colsb[c] != s.colsb[b] || s.colsb[c] % 4)
    Fault("tile shapes that do not multiply", c);
  return s;
}

// TDPBSSD / TDPBUSD: C[m][n] += sum over k, i < 4 of A[m][4k + i] * B[k][4n + i] in int32,
// wrapping (the hardware does not saturate). A's bytes signed or unsigned, B's signed. B is
// widened once into [4k + i][n] so the loop over n runs in vectors (the emulation stays fast
// enough for a test suite).
template <bool kSignedA>
inline void DotBytes(int c, int a, int b) {
  Tiles& s = Multiply(c, a, b);
  const int columns = s.colsb[c] / 4, depth = s.colsb[a];
  int32_t wide[64][16] = {};
  for (int k = 0; k < s.rows[b]; ++k)
    for (int n = 0; n < columns; ++n)
      for (int i = 0; i < 4; ++i) wide[4 * k + i][n] = static_cast<int8_t>(s.data[b][k][4 * n + i]);
  for (int m = 0; m < s.rows[c]; ++m) {
    uint32_t acc[16];
    std::memcpy(acc, s.data[c][m], 64);
    for (int j = 0; j < depth; ++j) {
      const uint8_t x = s.data[a][m][j];
      const uint32_t xv = static_cast<uint32_t>(kSignedA ? static_cast<int32_t>(static_cast<int8_t>(x)) : x);
      for (int n = 0; n < 16; ++n) acc[n] += xv * static_cast<uint32_t>(wide[j][n]);
    }
    std::memcpy(s.data[c][m], acc, 4 * columns);
  }
}

// A bfloat16's float32 value, denormals read as zero (TDPBF16PS's DAZ).
inline float Bf16(const uint8_t* at) {
  uint16_t bits;
  std::memcpy(&bits, at, 2);
  const uint32_t wide = (bits & 0x7F80u) ? static_cast<uint32_t>(bits) << 16 : static_cast<uint32_t>(bits & 0x8000u) << 16;
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
}

// TDPBF16PS, as Intel's pseudocode orders it: for each k, C[m][n] += A[m][2k] * B[k][2n], then
// += A[m][2k + 1] * B[k][2n + 1], in float32 (bfloat16 products are exact there), round to nearest
// even, denormal inputs and results flushed to zero. (library.py builds the emulation with
// -ffp-contract=off: a fused multiply-add would round a denormal product differently.)
inline void DotBf16(int c, int a, int b) {
  Tiles& s = Multiply(c, a, b);
  const int columns = s.colsb[c] / 4, depth = s.colsb[a] / 2;
  float wide[32][16] = {};
  for (int k = 0; k < s.rows[b]; ++k)
    for (int n = 0; n < columns; ++n)
      for (int i = 0; i < 2; ++i) wide[2 * k + i][n] = Bf16(&s.data[b][k][4 * n + 2 * i]);
  for (int m = 0; m < s.rows[c]; ++m) {
    float acc[16];
    std::memcpy(acc, s.data[c][m], 64);
    for (float& sum : acc) sum = std::fabs(sum) < 1.17549435e-38f ? std::copysign(0.0f, sum) : sum;  // DAZ
    for (int j = 0; j < depth; ++j) {
      const float x = Bf16(&s.data[a][m][2 * j]);
      for (int n = 0; n < 16; ++n) {
        const float sum = acc[n] + x * wide[j][n];
        acc[n] = std::fabs(sum) < 1.17549435e-38f ? std::copysign(0.0f, sum) : sum;  // FTZ
      }
    }
    std::memcpy(s.data[c][m], acc, 4 * columns);
  }
}

}  // namespace amx_emulation

// The intrinsics the kernels call, in place of <immintrin.h>'s (tile numbers stay immediates).
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#undef _tile_dpbusd
#undef _tile_dpbf16ps
#undef _tile_loadconfig  // inline functions in GCC's and clang's headers; macros in case they are not
#undef _tile_release
#define _tile_loadconfig(config) ::pathserve::amx_emulation::LoadConfig(config)
#define _tile_release() ::pathserve::amx_emulation::Release()
#define _tile_loadd(tile, base, stride) ::pathserve::amx_emulation::Load(tile, base, stride)
#define _tile_stored(tile, base, stride) ::pathserve::amx_emulation::Store(tile, base, stride)
#define _tile_zero(tile) ::pathserve::amx_emulation::Zero(tile)
#define _tile_dpbssd(c, a, b) ::pathserve::amx_emulation::DotBytes<true>(c, a, b)
#define _tile_dpbusd(c, a, b) ::pathserve::amx_emulation::DotBytes<false>(c, a, b)
#define _tile_dpbf16ps(c, a, b) ::pathserve::amx_emulation::DotBf16(c, a, b)

#endif  // PATHSERVE_HAS_AMX

#if PATHSERVE_HAS_AMX
// Asks for the 16 lines of a 1 KB weight tile.
inline void PrefetchTile(const void* next) {
  for (int i = 0; i < 16; ++i) _mm_prefetch(static_cast<const char*>(next) + 64 * i, _MM_HINT_T0);
}
#else
inline bool AmxReady(int) { return false; }
#endif

}  // namespace pathserve

#endif  // PATHSERVE_KERNELS_CPU_AMX_H_
