// AMX's tile operations as block_matmul_amx_impl.h uses them: the instructions themselves
// (SENDPATH_AMX_EMULATE undefined), or a software model of them written from Intel's
// definitions (SENDPATH_AMX_EMULATE), so that the kernels' layouts, tile shapes and
// fix-ups are tested on CPUs without AMX too. The model keeps each tile's rows and
// bytes a row from the configuration, zeroes what a load leaves past them, and sums
// in the order the definitions give:
//
//   tdpbsud   C[m][n] (int32) += sum over k < colsb(A)/4, i < 4 of
//                                  int8(A[m][4k+i]) * uint8(B[k][4n+i])
//   tdpbf16ps C[m][n] (fp32)  += A[m][2k] * B[k][2n], then += A[m][2k+1] * B[k][2n+1]
//                                  (bfloat16 widened; hardware flushes denormals, the
//                                  model does not: the tests compare bf16 with a tolerance)
//
// Only for the two AMX sources, which include no torch header: they are compiled for
// AVX-512 and AMX, and must share no inline code with the other sources, which run on
// every CPU (so all of this is in an anonymous namespace: each source has its own copy).

#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#ifndef SENDPATH_AMX_EMULATE
#include <immintrin.h>
#endif

namespace {
namespace tiles {

// The 64-byte operand of ldtilecfg (palette 1): bytes a row and rows of each tile.
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int rows_, int colsb_) {
    rows[tile] = static_cast<uint8_t>(rows_);
    colsb[tile] = static_cast<uint16_t>(colsb_);
  }
};

#ifndef SENDPATH_AMX_EMULATE

inline void configure(const Config& c) { _tile_loadconfig(&c); }
inline void release() { _tile_release(); }
// The instructions name their tiles in the opcode (GCC's intrinsics paste the number into
// the assembly), so each tile and each product used gets its own specialization.
template <int T>
void zero();
template <int T>
void load(const void* p, int64_t stride);
template <int T>
void store(void* p, int64_t stride);
template <int C, int A, int B>
void dpbsud();
template <int C, int A, int B>
void dpbf16ps();
#define SENDPATH_TILE(T)                                                                \
  template <>                                                                           \
  inline void zero<T>() { _tile_zero(T); }                                              \
  template <>                                                                           \
  inline void load<T>(const void* p, int64_t stride) { _tile_loadd(T, p, stride); }     \
  template <>                                                                           \
  inline void store<T>(void* p, int64_t stride) { _tile_stored(T, p, stride); }
SENDPATH_TILE(0)
SENDPATH_TILE(1)
SENDPATH_TILE(2)
SENDPATH_TILE(3)
SENDPATH_TILE(4)
SENDPATH_TILE(5)
SENDPATH_TILE(6)
SENDPATH_TILE(7)
#undef SENDPATH_TILE
#define SENDPATH_PRODUCT(C, A, B)                            \
  template <>                                                \
  inline void dpbsud<C, A, B>() { _tile_dpbsud(C, A, B); }   \
  template <>                                                \
  inline void dpbf16ps<C, A, B>() { _tile_dpbf16ps(C, A, B); }
SENDPATH_PRODUCT(0, 4, 6)
SENDPATH_PRODUCT(1, 5, 7)
SENDPATH_PRODUCT(2, 4, 6)
SENDPATH_PRODUCT(3, 5, 7)
SENDPATH_PRODUCT(1, 4, 7)
SENDPATH_PRODUCT(2, 5, 6)
SENDPATH_PRODUCT(1, 4, 6)
SENDPATH_PRODUCT(3, 4, 6)
#undef SENDPATH_PRODUCT

#else

struct State {
  Config config;
  alignas(64) uint8_t data[8][16 * 64];
};
inline State& state() {
  static thread_local State s;
  return s;
}
inline void configure(const Config& c) {
  state().config = c;
  std::memset(state().data, 0, sizeof(state().data));
}
inline void release() {}
template <int T>
inline void zero() { std::memset(state().data[T], 0, 16 * 64); }
template <int T>
inline void load(const void* p, int64_t stride) {
  State& s = state();
  std::memset(s.data[T], 0, 16 * 64);
  for (int r = 0; r < s.config.rows[T]; ++r)
    std::memcpy(s.data[T] + r * 64, static_cast<const uint8_t*>(p) + r * stride, s.config.colsb[T]);
}
template <int T>
inline void store(void* p, int64_t stride) {
  State& s = state();
  for (int r = 0; r < s.config.rows[T]; ++r)
    std::memcpy(static_cast<uint8_t*>(p) + r * stride, s.data[T] + r * 64, s.config.colsb[T]);
}
template <int C, int A, int B>
inline void dpbsud() {
  State& s = state();
  const int rows = s.config.rows[C], n_cols = s.config.colsb[C] / 4, k_quads = s.config.colsb[A] / 4;
  for (int m = 0; m < rows; ++m) {
    for (int n = 0; n < n_cols; ++n) {
      int32_t acc;
      std::memcpy(&acc, s.data[C] + m * 64 + n * 4, 4);
      for (int k = 0; k < k_quads; ++k)
        for (int i = 0; i < 4; ++i)
          acc += static_cast<int8_t>(s.data[A][m * 64 + k * 4 + i]) *
                 static_cast<int32_t>(s.data[B][k * 64 + n * 4 + i]);
      std::memcpy(s.data[C] + m * 64 + n * 4, &acc, 4);
    }
  }
}
inline float widen_bf16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}
template <int C, int A, int B>
inline void dpbf16ps() {
  State& s = state();
  const int rows = s.config.rows[C], n_cols = s.config.colsb[C] / 4, k_pairs = s.config.colsb[A] / 4;
  for (int m = 0; m < rows; ++m) {
    for (int n = 0; n < n_cols; ++n) {
      float acc;
      std::memcpy(&acc, s.data[C] + m * 64 + n * 4, 4);
      for (int k = 0; k < k_pairs; ++k) {
        const uint8_t* a = s.data[A] + m * 64 + k * 4;
        const uint8_t* b = s.data[B] + k * 64 + n * 4;
        acc += widen_bf16(a) * widen_bf16(b);
        acc += widen_bf16(a + 2) * widen_bf16(b + 2);
      }
      std::memcpy(s.data[C] + m * 64 + n * 4, &acc, 4);
    }
  }
}

#endif

// A thread's scratch for a kernel's buffers: grows, never shrinks, freed with the thread.
struct Scratch {
  void* p = nullptr;
  int64_t bytes = 0;
  ~Scratch() { std::free(p); }
  void* get(int64_t n) {
    if (n > bytes) {
      std::free(p);
      bytes = (n + 63) / 64 * 64;
      p = std::aligned_alloc(64, static_cast<size_t>(bytes));
    }
    return p;
  }
};

}  // namespace tiles
}  // namespace
