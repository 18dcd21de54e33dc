// paged_prefill_amx_impl.h on the AMX tiles: compiled for AVX-512 and AMX whatever the build
// machine, and called only where paged_prefill_bf16.cpp found the tiles usable at run time.

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma,amx-tile,amx-int8,amx-bf16")

#define SENDPATH_AMX_NS hw
#include "paged_prefill_amx_impl.h"
