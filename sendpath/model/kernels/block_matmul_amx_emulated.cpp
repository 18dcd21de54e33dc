// block_matmul_amx_impl.h on amx_tiles.h's software model of the tiles: the same layouts,
// shapes and fix-ups, on any CPU with AVX-512 BF16 (Zen 4 and later, Xeons since Cooper
// Lake), so the tests check the AMX designs where there is no AMX. Slow: for tests only.

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")

#define SENDPATH_AMX_EMULATE 1
#define SENDPATH_AMX_NS emulated
#include "block_matmul_amx_impl.h"
