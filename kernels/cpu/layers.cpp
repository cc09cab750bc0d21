// The model's elementwise layers on CPU, each one pass over memory instead of torch's chain of ops
// (RMSNorm is seven, rotate-half RoPE about ten, SiLU-and-mul three). The arithmetic is Hugging Face's,
// in float32 and with its roundings to the dtype, up to float rounding: RMSNorm's mean is summed in another
// order, and the build (-ffast-math) may fuse a multiply and an add. The torch references are the layers in
// engine/models/llama.py; tests/test_kernels_cpu.py holds each to them.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() >= 2 && x.stride(-1) == 1, name, " must have contiguous rows");
}

}  // namespace

// weight * (x * rsqrt(mean(x^2) + eps)), row by row over the last dimension of x [rows, hidden].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "rms_norm takes x [rows, hidden] and weight [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight must share a dtype");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* w = weight.data_ptr<scalar_t>();
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      std::vector<float> row(n), wf(n);
      load_row(w, wf.data(), n);
      for (int64_t r = r0; r < r1; ++r) {
        load_row(src + r * stride, row.data(), n);
        const float sum = at::vec::map_reduce_all<float>(
            [](Vec v) { return v * v; }, [](Vec a, Vec b) { return a + b; }, row.data(), n);
        const float inv = 1.f / std::sqrt(sum / n + static_cast<float>(eps));
        // HF rounds the normalised row to the input dtype before the weight multiplies it.
        for (int64_t i = 0; i < n; ++i) row[i] = static_cast<float>(static_cast<scalar_t>(row[i] * inv)) * wf[i];
        store_row(row.data(), dst + r * n, n);
      }
    });
  });
  return out;
}

// Rotate-half RoPE in place on q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] (rows may be
// strided, as the views of a fused qkv are): x * cos + rotate_half(x) * sin with cos/sin [tokens, head_dim].
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(2) == k.size(2) && q.size(0) == k.size(0), "bad q/k shapes");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q and k must have contiguous heads");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == q.size(2) && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "cos and sin must be contiguous [tokens, head_dim]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "q, k, cos and sin must share a dtype");
  const int64_t tokens = q.size(0), dim = q.size(2), half = dim / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
    struct Heads {
      scalar_t* base;
      int64_t count, token_stride, head_stride;
    };
    const Heads heads[] = {{q.data_ptr<scalar_t>(), q.size(1), q.stride(0), q.stride(1)},
                           {k.data_ptr<scalar_t>(), k.size(1), k.stride(0), k.stride(1)}};
    const scalar_t* cos_base = cos.data_ptr<scalar_t>();
    const scalar_t* sin_base = sin.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
      std::vector<float> c(dim), s(dim), x(dim);
      for (int64_t t = t0; t < t1; ++t) {
        load_row(cos_base + t * dim, c.data(), dim);
        load_row(sin_base + t * dim, s.data(), dim);
        for (const Heads& qk : heads) {
          for (int64_t h = 0; h < qk.count; ++h) {
            scalar_t* p = qk.base + t * qk.token_stride + h * qk.head_stride;
            load_row(p, x.data(), dim);
            for (int64_t i = 0; i < half; ++i) {
              // HF: each product rounded to the dtype, then the sum.
              p[i] = static_cast<scalar_t>(static_cast<float>(static_cast<scalar_t>(x[i] * c[i])) +
                                           static_cast<float>(static_cast<scalar_t>(-x[i + half] * s[i])));
              p[i + half] = static_cast<scalar_t>(static_cast<float>(static_cast<scalar_t>(x[i + half] * c[i + half])) +
                                                  static_cast<float>(static_cast<scalar_t>(x[i] * s[i + half])));
            }
          }
        }
      }
    });
  });
}

// silu(x[:, :d]) * x[:, d:] for x [rows, 2d]: the gate and up halves of a fused gate_up projection.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul takes x [rows, 2 * d]");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  at::Tensor out = at::empty({rows, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* x_base = x.data_ptr<scalar_t>();
    scalar_t* out_base = out.data_ptr<scalar_t>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
      std::vector<float> g(d), u(d);
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* src = x_base + r * stride;
        load_row(src, g.data(), d);
        load_row(src + d, u.data(), d);
        // torch's silu kernel: x / (1 + exp(-x)), rounded to the dtype before the multiply.
        at::vec::map([](Vec v) { return v / (Vec(1.f) + v.neg().exp()); }, g.data(), g.data(), d);
        scalar_t* dst = out_base + r * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<scalar_t>(static_cast<float>(static_cast<scalar_t>(g[i])) * u[i]);
      }
    });
  });
  return out;
}
