// paged_prefill_amx_impl.h on amx_tiles.h's software model of the tiles, for the tests on
// CPUs with AVX-512 BF16 but no AMX. Slow: for tests only.

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")

#define SENDPATH_AMX_EMULATE 1
#define SENDPATH_AMX_NS emulated
#include "paged_prefill_amx_impl.h"
