// block_matmul's matrix engine: whether AMX's tiles run in this process (asked for once),
// and a product handed to block_matmul_amx.h's designs, on the tiles or on their software
// model, a thread's run of weight groups at a time. block_matmul.cpp picks the loop.

#include "block_matmul.h"
#include "block_matmul_amx.h"

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace sendpath_blocks {

// What the AMX sources need besides the tiles (their fix-ups and dequantization); where it
// runs, so does their software model of the tiles.
bool amx_emulation_runs() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("fma");
}

namespace {

std::string probe_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)) ||
      !(d & (1u << 22)))
    return "the CPU has no AMX tiles (amx_tile, amx_int8, amx_bf16)";
  if (!amx_emulation_runs()) return "the CPU has AMX but not AVX-512 BF16, which the fix-ups use";
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0)
    return std::string("Linux refused the tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM: ") +
           std::strerror(errno) + "; Linux 5.16 and later grant it)";
  return "";
}

}  // namespace

// Why AMX's tiles cannot be used in this process, or "" where they can: the CPU has them
// (amx_tile, amx_int8, amx_bf16) and Linux granted the process their 8 KB of state, asked
// for once (arch_prctl ARCH_REQ_XCOMP_PERM; a process has none until it asks).
const std::string& amx_unavailable() {
  static const std::string reason = probe_amx();  // the permission is asked for once
  return reason;
}

namespace {

sendpath_amx::Weights amx_weights(const Packed& w) {
  return {w.codes, reinterpret_cast<const uint16_t*>(w.d), reinterpret_cast<const uint16_t*>(w.m),
          w.blocks, w.block_bytes, w.four_bit};
}

inline int64_t padded(int64_t rows) {
  return (rows + sendpath_amx::kTileRows - 1) / sendpath_amx::kTileRows * sendpath_amx::kTileRows;
}

sendpath_amx::Output output(float* out) { return {out, nullptr}; }
sendpath_amx::Output output(at::BFloat16* out) {
  return {nullptr, reinterpret_cast<uint16_t*>(out)};
}

template <typename T>
void run_on_tiles(const Packed& w, const T* x, int64_t rows, int64_t k, T* y, int64_t n_out,
                  Amx design, bool emulated) {
  const int64_t groups = (n_out + kLanes - 1) / kLanes;
  const sendpath_amx::Weights weights = amx_weights(w);
  const sendpath_amx::Output out = output(y);
  if (design == Amx::kInt8) {
    const Quantized q = quantize(x, rows, k, padded(rows));
    const sendpath_amx::Int8Rows a{q.q.data(), q.scale.data(), q.scaled_sum.data(), rows,
                                   padded(rows), q.blocks};
    at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
      if (emulated) sendpath_amx::emulated::groups_int8(weights, a, out, n_out, begin, end);
      else sendpath_amx::hw::groups_int8(weights, a, out, n_out, begin, end);
    });
    return;
  }
  // bfloat16 activations, zero past the rows and past k (the tiles take whole blocks and
  // 16 rows a tile): bfloat16 rows of whole blocks are read where they are, but for the
  // last partial tile; others (float32, or K not a multiple of 32) are copied
  const bool in_place = std::is_same_v<T, at::BFloat16> && k == w.blocks * kBlock;
  const int64_t tail_from = in_place ? rows / sendpath_amx::kTileRows * sendpath_amx::kTileRows : 0;
  auto xb = torch::zeros({padded(rows) - tail_from, w.blocks * kBlock}, torch::kBFloat16);
  const auto dtype = std::is_same_v<T, float> ? torch::kFloat : torch::kBFloat16;
  xb.narrow(0, 0, rows - tail_from).narrow(1, 0, k).copy_(
      torch::from_blob(const_cast<T*>(x), {rows, k}, torch::TensorOptions().dtype(dtype))
          .narrow(0, tail_from, rows - tail_from));
  const sendpath_amx::Bf16Rows a{in_place ? reinterpret_cast<const uint16_t*>(x) : nullptr,
                                 reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()),
                                 tail_from, rows, padded(rows), w.blocks};
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    if (emulated) sendpath_amx::emulated::groups_bf16(weights, a, out, n_out, begin, end);
    else sendpath_amx::hw::groups_bf16(weights, a, out, n_out, begin, end);
  });
}

}  // namespace

void run_amx(const Packed& w, const float* x, int64_t rows, int64_t k, float* out, int64_t n_out,
             Amx design, bool emulated) {
  run_on_tiles(w, x, rows, k, out, n_out, design, emulated);
}
void run_amx(const Packed& w, const at::BFloat16* x, int64_t rows, int64_t k, at::BFloat16* out,
             int64_t n_out, Amx design, bool emulated) {
  run_on_tiles(w, x, rows, k, out, n_out, design, emulated);
}

}  // namespace sendpath_blocks

// The matrix-engine loops block_matmul runs on this CPU (amx-bf16, the default's, then
// amx-int8), or none.
std::vector<std::string> matrix_loops() {
  if (!sendpath_blocks::amx_unavailable().empty()) return {};
  return {"amx-bf16", "amx-int8"};
}

// Why matrix_loops() is empty here ("" where it is not).
std::string matrix_unavailable() { return sendpath_blocks::amx_unavailable(); }

// The rows from which block_matmul's default takes each of matrix_loops() (in its order).
std::vector<int64_t> matrix_min_rows() {
  return {sendpath_blocks::kAmxBf16MinRows, sendpath_blocks::kAmxInt8MinRows};
}
