// The CPU kernels (torch.ops.nanoserve_cpu), built on first use by cpu_ops.py. Each computes what its
// reference.py counterpart computes, in float32, rounding to the tensors' dtype where the reference rounds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kWidth = Vec::size();

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

// rows per task for elementwise work, as torch sizes its own: a step's few rows run on the calling thread, where
// waking the other threads would cost more than the work (and a busy core would stall every call)
inline int64_t grain_rows(int64_t row_numel) { return std::max<int64_t>(1, at::internal::GRAIN_SIZE / row_numel); }

template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

// x [n] as float32: x itself, or converted into buf
template <typename T>
inline const float* as_float(const T* x, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = f32(x[i]);
    return buf;
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + 2 * kWidth <= n; i += 2 * kWidth) {
    acc0 = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + i + kWidth), Vec::loadu(b + i + kWidth), acc1);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc0 + acc1);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void add_scaled(float* acc, float p, const float* v, int64_t n) {  // acc += p * v
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) at::vec::fmadd(Vec(p), Vec::loadu(v + i), Vec::loadu(acc + i)).store(acc + i);
  for (; i < n; ++i) acc[i] += p * v[i];
}

inline float exp_and_sum(float* s, int64_t n, float top) {  // s = exp(s - top); returns the sum
  Vec sum(0.f);
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    const Vec e = (Vec::loadu(s + i) - Vec(top)).exp_u20();
    e.store(s + i);
    sum = sum + e;
  }
  float total = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
  for (; i < n; ++i) total += (s[i] = std::exp(s[i] - top));
  return total;
}

struct PagedCache {
  int64_t block_size, kv_heads, head_dim;
  const int32_t* block_table;  // this sequence's row
  int64_t block_offset(int64_t i) const {  // element offset of its i-th block [block_size, kv_heads, head_dim]
    return block_table[i] * block_size * kv_heads * head_dim;
  }
};

// f(t, K or V [kv_heads, head_dim] of token t) for the ctx tokens of a sequence, block by block. The next
// block is prefetched: blocks lie anywhere in the cache, and the hardware prefetchers stop at page boundaries.
template <typename T, typename F>
inline void for_each_token(const T* cache, const PagedCache& layout, int64_t ctx, F f) {
  const int64_t token_numel = layout.kv_heads * layout.head_dim;
  const int64_t lines_per_token = std::max<int64_t>(1, token_numel * sizeof(T) / 64);
  for (int64_t i = 0, t0 = 0; t0 < ctx; ++i, t0 += layout.block_size) {
    const T* block = cache + layout.block_offset(i);
    const int64_t n = std::min(layout.block_size, ctx - t0);
    const bool has_next = t0 + n < ctx;
    const char* next = has_next ? reinterpret_cast<const char*>(cache + layout.block_offset(i + 1)) : nullptr;
    const int64_t next_n = has_next ? std::min(layout.block_size, ctx - t0 - n) : 0;
    for (int64_t t = 0; t < n; ++t) {
      if (t < next_n)
        for (int64_t l = 0; l < lines_per_token; ++l) __builtin_prefetch(next + (t * lines_per_token + l) * 64);
      f(t0 + t, block + t * token_numel);
    }
  }
}

// One decode sequence: its single query row q [heads, head_dim] against its context of ctx tokens.
// Scores for every head first (they fit in cache), then a softmax per head, then P @ V.
template <typename T>
void decode_one(T* out, int64_t out_head_stride, const T* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                const PagedCache& cache, int64_t heads, int64_t ctx, float scale, std::vector<float>& work) {
  const int64_t d = cache.head_dim, group = heads / cache.kv_heads, token_numel = cache.kv_heads * d;
  work.assign(heads * d + heads * ctx + heads * d + token_numel, 0.f);
  float *q32 = work.data(), *scores = q32 + heads * d, *acc = scores + heads * ctx, *row = acc + heads * d;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < d; ++i) q32[h * d + i] = f32(q[h * q_head_stride + i]) * scale;
  for_each_token(k_cache, cache, ctx, [&](int64_t t, const T* k_token) {
    const float* k = as_float(k_token, row, token_numel);
    for (int64_t j = 0, h = 0; j < cache.kv_heads; ++j)
      for (int64_t g = 0; g < group; ++g, ++h) scores[h * ctx + t] = dot(q32 + h * d, k + j * d, d);
  });
  std::vector<float> inv_sum(heads);
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * ctx;
    inv_sum[h] = 1.f / exp_and_sum(s, ctx, *std::max_element(s, s + ctx));
  }
  for_each_token(v_cache, cache, ctx, [&](int64_t t, const T* v_token) {
    const float* v = as_float(v_token, row, token_numel);
    for (int64_t j = 0, h = 0; j < cache.kv_heads; ++j)
      for (int64_t g = 0; g < group; ++g, ++h) add_scaled(acc + h * d, scores[h * ctx + t], v + j * d, d);
  });
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < d; ++i) out[h * out_head_stride + i] = static_cast<T>(acc[h * d + i] * inv_sum[h]);
}

// out[query_start_loc[b]] for every sequence b with one query token (the others, prefills, are left alone).
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.sizes() == q.sizes() && out.stride(2) == 1 &&
              out.scalar_type() == q.scalar_type(), "q, out: [tokens, heads, head_dim], the last dim contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == q.scalar_type() &&
              v_cache.scalar_type() == q.scalar_type(), "k_cache, v_cache: contiguous, of q's dtype");
  const auto tables = block_tables.to(at::kInt).contiguous();
  const auto starts = query_start_loc.to(at::kLong).contiguous();
  const auto lens = seq_lens.to(at::kLong).contiguous();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t heads = q.size(1), width = tables.size(1), block_size = k_cache.size(1);
  TORCH_CHECK(starts.numel() == lens.numel() + 1 && tables.size(0) >= lens.numel() && heads % k_cache.size(2) == 0,
              "query_start_loc: [batch + 1]; block_tables: [batch, width]; heads: a multiple of kv_heads");
  std::vector<int64_t> decodes;
  for (int64_t b = 0; b < lens.numel(); ++b) {
    if (start[b + 1] - start[b] != 1 || len[b] == 0) continue;
    TORCH_CHECK(len[b] <= width * block_size, "seq_lens[", b, "] is past its block table's ", width, " blocks");
    decodes.push_back(b);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    at::parallel_for(0, decodes.size(), 1, [&](int64_t first, int64_t last) {
      std::vector<float> work;
      for (int64_t i = first; i < last; ++i) {
        const int64_t b = decodes[i], row = start[b];
        const PagedCache cache{block_size, k_cache.size(2), k_cache.size(3),
                               tables.data_ptr<int32_t>() + b * width};
        decode_one<scalar_t>(out.data_ptr<scalar_t>() + row * out.stride(0), out.stride(1),
                             q.data_ptr<scalar_t>() + row * q.stride(0), q.stride(1), k_cache.data_ptr<scalar_t>(),
                             v_cache.data_ptr<scalar_t>(), cache, heads, len[b], static_cast<float>(scale), work);
      }
    });
  });
}

// rms_norm_ref on each row of x [rows, n]: x * rsqrt(mean(x^2) + eps), rounded, times weight.
template <typename T>
void rms_norm_rows(T* out, const T* x, const T* weight, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* xr = x + r * n;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < n; ++i) squares += f32(xr[i]) * f32(xr[i]);
      const float inv_rms = 1.f / std::sqrt(squares / n + eps);
      for (int64_t i = 0; i < n; ++i) out[r * n + i] = static_cast<T>(round_to<T>(f32(xr[i]) * inv_rms) * f32(weight[i]));
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1) &&
              weight.scalar_type() == x.scalar_type(), "x: [rows, n]; weight: [n] of x's dtype");
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  const auto x = x_in.contiguous();
  check_norm_args(x, weight);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), x.size(0),
                  x.size(1), static_cast<float>(eps));
  });
  return out;
}

// fused_add_rms_norm_ref: (rms_norm(x + residual), x + residual), the sum rounded to x's dtype.
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x_in, const at::Tensor& residual_in,
                                                      const at::Tensor& weight, double eps) {
  const auto x = x_in.contiguous(), residual = residual_in.contiguous();
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual: x's shape and dtype");
  auto summed = at::empty_like(x), out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    const scalar_t *a = x.data_ptr<scalar_t>(), *b = residual.data_ptr<scalar_t>();
    scalar_t* s = summed.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), at::internal::GRAIN_SIZE, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) s[i] = static_cast<scalar_t>(f32(a[i]) + f32(b[i]));
    });
    rms_norm_rows(out.data_ptr<scalar_t>(), s, weight.data_ptr<scalar_t>(), x.size(0), x.size(1),
                  static_cast<float>(eps));
  });
  return {out, summed};
}

// rotary_ref (rotate-half): x [tokens, heads, head_dim] (last dim contiguous) with cos/sin [tokens, head_dim / 2].
template <typename T>
void rotate_rows(T* out, const at::Tensor& x, const float* cos, const float* sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const T* in = x.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows(heads * 2 * half), [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const float *c = cos + t * half, *s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = in + t * x.stride(0) + h * x.stride(1);
        T* oh = out + (t * heads + h) * 2 * half;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = f32(xh[i]), x2 = f32(xh[i + half]);
          oh[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
          oh[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) % 2 == 0 &&
              k.scalar_type() == q.scalar_type(), "q, k: [tokens, heads, head_dim] of one dtype");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == q.size(0) && cos.size(1) * 2 == q.size(2),
              "cos, sin: [tokens, head_dim / 2]");
  const auto cos32 = cos.to(at::kFloat).contiguous(), sin32 = sin.to(at::kFloat).contiguous();
  auto q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    rotate_rows(q_out.data_ptr<scalar_t>(), q, cos32.data_ptr<float>(), sin32.data_ptr<float>());
    rotate_rows(k_out.data_ptr<scalar_t>(), k, cos32.data_ptr<float>(), sin32.data_ptr<float>());
  });
  return {q_out, k_out};
}

// silu_and_mul_ref: [..., 2n] (gate | up) -> silu(gate) * up [..., n], silu rounded to x's dtype first.
at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) % 2 == 0, "x: [..., 2n]");
  const auto x = x_in.reshape({-1, x_in.size(-1)}).contiguous();
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  auto out_shape = x_in.sizes().vec();
  out_shape.back() = n;
  auto out = at::empty(out_shape, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t first, int64_t last) {
      std::vector<float> buf(3 * n);
      for (int64_t r = first; r < last; ++r) {
        const scalar_t* in = x.data_ptr<scalar_t>() + r * 2 * n;
        const float *gate = as_float(in, buf.data(), n), *up = as_float(in + n, buf.data() + n, n);
        float* silu = buf.data() + 2 * n;
        int64_t i = 0;
        for (; i + kWidth <= n; i += kWidth) {
          const Vec g = Vec::loadu(gate + i);
          (g / (Vec(1.f) + g.neg().exp_u20())).store(silu + i);
        }
        for (; i < n; ++i) silu[i] = gate[i] / (1.f + std::exp(-gate[i]));
        scalar_t* o = out.data_ptr<scalar_t>() + r * n;
        for (i = 0; i < n; ++i) o[i] = static_cast<scalar_t>(round_to<scalar_t>(silu[i]) * up[i]);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(nanoserve_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale) -> ()", &paged_decode_attention);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &fused_add_rms_norm);
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)", &rotary);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
}
