// The small operations around a decoder layer's matmuls, each fused into one pass.
//
// A decode step of a small model spends more time between its matmuls than in them: at
// one row, every torch op costs its dispatch (a few microseconds) and a layer had about
// twenty-five of them (the residual adds, the norms, RoPE's multiplies and roll, the two
// cache writes, SiLU and its product). These four do the same work in four calls, as
// vLLM's CPU backend does (its fused_add_rms_norm, rotary_embedding, reshape_and_cache
// and silu_and_mul):
//
//   fused_add_rms_norm(x, residual, weight, eps)   residual += x; x = rms_norm(residual) * weight
//   rotary_(qkv, cos, sin, heads, head_dim)        RoPE on the first `heads` heads of each row
//   write_kv(k, v, k_cache, v_cache, slots)        each token's k/v into its cache slot
//   silu_and_mul(gate_up) -> out                   silu(gate) * up, gate and up side by side
//
// Inputs are float32 or bfloat16; arithmetic is float32, rounded once per output (where
// torch's ops round after each of them). Rows are split over torch's thread pool when
// there are enough of them to pay for it.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace {

// bfloat16 is a float32's upper half: widening is a shift, narrowing rounds to nearest even.
inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) { return x; }
template <>
inline at::BFloat16 narrow<at::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  uint16_t top = std::isnan(x) ? uint16_t{0x7FC0}
                               : static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  return at::BFloat16(top, at::BFloat16::from_bits());
}

// Split `rows` over the pool when a row's `width` elements make enough work in all.
template <typename F>
void for_rows(int64_t rows, int64_t width, const F& body) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

template <typename T>
void rotary_rows(T* qkv, int64_t row_stride, const T* cos, const T* sin, int64_t rows,
                 int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for_rows(rows, heads * dim, [&](int64_t r) {
    const T* c = cos + r * dim;
    const T* s = sin + r * dim;  // first half negated: x*cos + (b, a)*sin is the rotation
#ifdef SENDPATH_VEC
    if (half % sendpath_vec::kWidth == 0) {  // each half a register (or more) at a time
      using namespace sendpath_vec;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qkv + r * row_stride + h * dim;
        for (int64_t d = 0; d < half; d += kWidth) {
          const Vec a = load(x + d), b = load(x + d + half);
          store(x + d, fma(a, load(c + d), mul(b, load(s + d))));
          store(x + d + half, fma(b, load(c + d + half), mul(a, load(s + d + half))));
        }
      }
      return;
    }
#endif
    std::vector<float> buf(dim);
    for (int64_t h = 0; h < heads; ++h) {
      T* x = qkv + r * row_stride + h * dim;
      for (int64_t d = 0; d < dim; ++d) buf[d] = widen(x[d]);
      for (int64_t d = 0; d < dim; ++d) {
        const float partner = buf[d < half ? d + half : d - half];
        x[d] = narrow<T>(buf[d] * widen(c[d]) + partner * widen(s[d]));
      }
    }
  });
}

template <typename T>
void add_rms_norm_rows(T* x, T* residual, const T* weight, int64_t rows, int64_t dim, float eps) {
  for_rows(rows, dim, [&](int64_t r) {
    T* xr = x + r * dim;
    T* rr = residual + r * dim;
    float squares = 0.f;
    int64_t d = 0;
#ifdef SENDPATH_VEC
    using namespace sendpath_vec;
    Vec acc = zero();
    for (; d + kWidth <= dim; d += kWidth) {  // the stream as stored (rounded), then its squares
      store(rr + d, add(load(rr + d), load(xr + d)));
      const Vec s = load(rr + d);
      acc = fma(s, s, acc);
    }
    squares = sum(acc);
#endif
    for (; d < dim; ++d) {
      rr[d] = narrow<T>(widen(rr[d]) + widen(xr[d]));
      squares += widen(rr[d]) * widen(rr[d]);
    }
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
    d = 0;
#ifdef SENDPATH_VEC
    const Vec scale = set1(inv);
    for (; d + kWidth <= dim; d += kWidth)
      store(xr + d, mul(mul(load(rr + d), scale), load(weight + d)));
#endif
    for (; d < dim; ++d) xr[d] = narrow<T>(widen(rr[d]) * inv * widen(weight[d]));
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
  for_rows(rows, width, [&](int64_t r) {
    const T* g = gate_up + r * 2 * width;
    const T* u = g + width;
    T* o = out + r * width;
    int64_t d = 0;
#ifdef SENDPATH_VEC
    using namespace sendpath_vec;
    const Vec one = set1(1.f);
    for (; d + kWidth <= width; d += kWidth) {
      const Vec a = load(g + d);
      const Vec sig = div(one, add(one, exp(sub(zero(), a))));
      store(o + d, mul(mul(a, sig), load(u + d)));
    }
#endif
    for (; d < width; ++d) {
      const float a = widen(g[d]);
      o[d] = narrow<T>(a / (1.f + std::exp(-a)) * widen(u[d]));
    }
  });
}

void check_floating(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

}  // namespace

// x, residual [T, D] contiguous, weight [D]: residual += x, x = rms_norm(residual) * weight.
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_floating(x, "x");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous());
  TORCH_CHECK(x.sizes() == residual.sizes() && x.dim() == 2 && weight.size(0) == x.size(1));
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type());
  AT_DISPATCH_SWITCH(x.scalar_type(), "fused_add_rms_norm",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        add_rms_norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(),
                          x.size(0), x.size(1), static_cast<float>(eps));
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        add_rms_norm_rows(x.data_ptr<at::BFloat16>(), residual.data_ptr<at::BFloat16>(),
                          weight.data_ptr<at::BFloat16>(), x.size(0), x.size(1), static_cast<float>(eps));
      }));
}

// qkv [T, N] (rows contiguous, any row stride), cos, sin [T, Dh] (or [T, 1, Dh]) contiguous: RoPE in place
// on heads 0..heads-1 of each row (queries then keys; the values after them are left alone).
void rotary_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim) {
  check_floating(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= heads * head_dim);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == qkv.size(0) * head_dim);
  TORCH_CHECK(sin.sizes() == cos.sizes() && head_dim % 2 == 0);
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type());
  AT_DISPATCH_SWITCH(qkv.scalar_type(), "rotary_",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        rotary_rows(qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                    qkv.size(0), heads, head_dim);
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        rotary_rows(qkv.data_ptr<at::BFloat16>(), qkv.stride(0), cos.data_ptr<at::BFloat16>(),
                    sin.data_ptr<at::BFloat16>(), qkv.size(0), heads, head_dim);
      }));
}

// One row of an int8 cache: `dim` codes, round(x / scale), then the float32 scale,
// max |x| / 127 (0 for a row of zeros). llama.cpp's q8_0 cache keeps a scale per 32 values;
// one per (token, kv head) row is as exact here (a row's values share their range) and
// reads one float per row.
template <typename T>
void quantize_row(const T* x, int64_t dim, int8_t* out) {
  float most = 0.f;
  int64_t d = 0;
#ifdef SENDPATH_VEC
  using namespace sendpath_vec;
  alignas(64) float lanes[kWidth];
  Vec top = zero();
  for (; d + kWidth <= dim; d += kWidth) {
    const Vec v = load(x + d);
    top = max(top, max(v, sub(zero(), v)));
  }
  store(lanes, top);
  for (int64_t i = 0; i < kWidth; ++i) most = std::max(most, lanes[i]);
#endif
  for (; d < dim; ++d) most = std::max(most, std::abs(widen(x[d])));
  const float scale = most / 127.f, inv = most > 0.f ? 127.f / most : 0.f;
  d = 0;
#ifdef SENDPATH_VEC
  for (; d + kWidth <= dim; d += kWidth) {  // rounded to nearest even, as lrintf below
    store(lanes, round(min(max(mul(load(x + d), set1(inv)), set1(-127.f)), set1(127.f))));
    for (int64_t i = 0; i < kWidth; ++i) out[d + i] = static_cast<int8_t>(lanes[i]);
  }
#endif
  for (; d < dim; ++d)
    out[d] = static_cast<int8_t>(std::lrintf(std::clamp(widen(x[d]) * inv, -127.f, 127.f)));
  std::memcpy(out + dim, &scale, sizeof(scale));
}

template <typename T>
void write_int8(const torch::Tensor& x, torch::Tensor& cache, const int64_t* slot) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t row = cache.size(2), capacity = cache.size(1);
  auto* out = cache.data_ptr<int8_t>();
  const T* in = x.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      quantize_row(in + t * x.stride(0) + h * x.stride(1), dim,
                   out + (h * capacity + slot[t]) * row);
}

// k, v [T, Hkv, Dh] (last dim contiguous, any other strides); k_cache, v_cache [Hkv, S, Dh]
// contiguous; slots [T] int64: cache[h, slots[t]] = k[t, h] (and v). An int8 cache
// (`--kv-cache-dtype int8`) has rows of Dh + 4 bytes: the row's codes and its scale.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3);
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type());
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_cache.size(0) == k.size(1) && v_cache.sizes() == k_cache.sizes());
  TORCH_CHECK(k_cache.size(2) == k.size(2) + (int8 ? kInt8ScaleBytes : 0),
              "the cache's rows do not fit the head dim");
  TORCH_CHECK(int8 || k.scalar_type() == k_cache.scalar_type(), "k and the cache differ in dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0));
  auto where = slots.contiguous();
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2), capacity = k_cache.size(1);
  const int64_t* slot = where.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot ", slot[t], " is outside the cache");
  if (int8) {
    AT_DISPATCH_SWITCH(k.scalar_type(), "write_kv",
        AT_DISPATCH_CASE(at::kFloat, [&] {
          write_int8<float>(k, k_cache, slot);
          write_int8<float>(v, v_cache, slot);
        })
        AT_DISPATCH_CASE(at::kBFloat16, [&] {
          write_int8<at::BFloat16>(k, k_cache, slot);
          write_int8<at::BFloat16>(v, v_cache, slot);
        }));
    return;
  }
  const auto bytes = k.element_size() * dim;
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const auto es = k.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t dst = (h * capacity + slot[t]) * bytes;
      std::memcpy(kc + dst, ks + (t * k.stride(0) + h * k.stride(1)) * es, bytes);
      std::memcpy(vc + dst, vs + (t * v.stride(0) + h * v.stride(1)) * es, bytes);
    }
  }
}

// gate_up [T, 2F] contiguous -> [T, F]: silu(gate_up[:, :F]) * gate_up[:, F:].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_floating(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0);
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({rows, width}, gate_up.options());
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "silu_and_mul",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, width);
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, width);
      }));
  return out;
}
