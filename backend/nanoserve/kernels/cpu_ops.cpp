// The CPU kernels (torch.ops.nanoserve_cpu), built by cpu_ops.py when a model runner starts on the CPU. Each
// computes what its reference.py counterpart computes, in float32, rounding to the dtype where the reference rounds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

// float32, bfloat16 and float16 (no double: at::vec converts only these to float)
#define DISPATCH_FLOATS(TYPE, NAME, ...)                                                                    \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                                  \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kWidth = Vec::size();

using Fp8 = c10::Float8_e4m3fn;  // an fp8 KV cache's elements (kv_cache_dtype="fp8")

// An e4m3 byte's sign, exponent and mantissa moved into a float16's places make the same number times 2^-8
// (subnormals too): a shift, and F16C's vectorized conversion, instead of c10's bit arithmetic per element. The
// decode kernel multiplies the 2^8 back into its scales (kFp8Unit).
constexpr float kFp8Unit = 256.f;
inline uint16_t fp8_as_half_bits(uint8_t x) { return static_cast<uint16_t>(((x & 0x80) << 8) | ((x & 0x7F) << 7)); }

// x as float32 (an fp8 x times 2^-8, as load_float reads it)
template <typename T>
inline float f32(T x) {
  if constexpr (std::is_same_v<T, Fp8>)
    return static_cast<float>(c10::Half(fp8_as_half_bits(x.x), c10::Half::from_bits()));
  else
    return static_cast<float>(x);
}

// rows per task for elementwise work, as torch sizes its own: a step's few rows run on the calling thread, where
// waking the other threads would cost more than the work (and a busy core would stall every call)
inline int64_t grain_rows(int64_t row_numel) { return std::max<int64_t>(1, at::internal::GRAIN_SIZE / row_numel); }

template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

template <typename T>
inline Vec load_float(const T* x) {  // kWidth elements as float32
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(x);
  } else if constexpr (std::is_same_v<T, Fp8>) {  // times 2^-8, as f32
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), 7));
    return Vec(_mm512_cvtph_ps(bits));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
    const __m128i bits = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8),
                                      _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x7F)), 7));
    return Vec(_mm256_cvtph_ps(bits));
#else
    uint16_t bits[kWidth];
    for (int64_t i = 0; i < kWidth; ++i) bits[i] = fp8_as_half_bits(x[i].x);
    return load_float(reinterpret_cast<const c10::Half*>(bits));
#endif
  } else {
    Vec v;
    at::vec::load_to_float(x, v);
    return v;
  }
}

// x [n] as float32: x itself, or converted into buf
template <typename T>
inline const float* as_float(const T* x, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    int64_t i = 0;
    for (; i + kWidth <= n; i += kWidth) load_float(x + i).store(buf + i);
    for (; i < n; ++i) buf[i] = f32(x[i]);
    return buf;
  }
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  Vec acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + 2 * kWidth <= n; i += 2 * kWidth) {
    acc0 = at::vec::fmadd(Vec::loadu(a + i), load_float(b + i), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + i + kWidth), load_float(b + i + kWidth), acc1);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc0 + acc1);
  for (; i < n; ++i) sum += a[i] * f32(b[i]);
  return sum;
}

// acc [d] += sum over t < n of p[t] * v[t * stride .. + d], for the few tokens of a piece (for_each_piece): acc is
// read and written once per piece instead of once per token, and two accumulators keep the multiply-adds apart
template <typename T>
inline void add_weighted_rows(float* acc, const float* p, const T* v, int64_t stride, int64_t n, int64_t d) {
  int64_t c = 0;
  for (; c + kWidth <= d; c += kWidth) {
    Vec a0 = Vec::loadu(acc + c), a1(0.f);
    int64_t t = 0;
    for (; t + 2 <= n; t += 2) {
      a0 = at::vec::fmadd(Vec(p[t]), load_float(v + t * stride + c), a0);
      a1 = at::vec::fmadd(Vec(p[t + 1]), load_float(v + (t + 1) * stride + c), a1);
    }
    if (t < n) a0 = at::vec::fmadd(Vec(p[t]), load_float(v + t * stride + c), a0);
    (a0 + a1).store(acc + c);
  }
  for (; c < d; ++c)
    for (int64_t t = 0; t < n; ++t) acc[c] += p[t] * f32(v[t * stride + c]);
}

inline float max_of(const float* s, int64_t n) {
  Vec top(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) top = at::vec::maximum(top, Vec::loadu(s + i));
  float result = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, top);
  for (; i < n; ++i) result = std::max(result, s[i]);
  return result;
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

// f(t0, n, tokens) over a sequence's ctx tokens, a few at a time: tokens [n, kv_heads, head_dim] are t0..t0+n-1,
// within one block. Each call first prefetches the same tokens of the next block: blocks lie anywhere in the
// cache, and the hardware prefetchers stop at page boundaries.
template <typename T, typename F>
inline void for_each_piece(const T* cache, const PagedCache& layout, int64_t ctx, F f) {
  constexpr int64_t kPiece = 2;  // measured: 2 to 4 tokens; 8 lets fp32 rows wait on memory
  const int64_t token_numel = layout.kv_heads * layout.head_dim;
  for (int64_t i = 0, t0 = 0; t0 < ctx; ++i, t0 += layout.block_size) {
    const T* block = cache + layout.block_offset(i);
    const int64_t n = std::min(layout.block_size, ctx - t0), next_n = std::min(layout.block_size, ctx - t0 - n);
    const char* next = reinterpret_cast<const char*>(next_n > 0 ? cache + layout.block_offset(i + 1) : block);
    for (int64_t t = 0; t < n; t += kPiece) {
      const int64_t piece = std::min(kPiece, n - t), ahead = std::min(piece, next_n - t) * token_numel * sizeof(T);
      for (int64_t byte = 0; byte < ahead; byte += 64) __builtin_prefetch(next + t * token_numel * sizeof(T) + byte);
      f(t0 + t, piece, block + t * token_numel);
    }
  }
}

// One decode sequence: its single query row q [heads, head_dim] against its context of ctx tokens.
// Scores for every head first (they fit in cache), then a softmax per head, then P @ V. The cache holds T, or fp8
// (C) whose values are k_scale, v_scale times what it holds: k_scale joins the softmax scale, v_scale the 1 / sum.
template <typename T, typename C>
void decode_one(T* out, int64_t out_head_stride, const T* q, int64_t q_head_stride, const C* k_cache, const C* v_cache,
                const PagedCache& cache, int64_t heads, int64_t ctx, float scale, float v_scale,
                std::vector<float>& work) {
  const int64_t d = cache.head_dim, group = heads / cache.kv_heads;
  work.assign(heads * d + heads * ctx + heads * d + heads, 0.f);
  float *q32 = work.data(), *scores = q32 + heads * d, *acc = scores + heads * ctx, *inv_sum = acc + heads * d;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < d; ++i) q32[h * d + i] = f32(q[h * q_head_stride + i]) * scale;
  const int64_t token_numel = cache.kv_heads * d;
  for_each_piece(k_cache, cache, ctx, [&](int64_t t0, int64_t n, const C* k) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < heads; ++h)
        scores[h * ctx + t0 + t] = dot(q32 + h * d, k + t * token_numel + h / group * d, d);
  });
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * ctx;
    inv_sum[h] = v_scale / exp_and_sum(s, ctx, max_of(s, ctx));
  }
  for_each_piece(v_cache, cache, ctx, [&](int64_t t0, int64_t n, const C* v) {
    for (int64_t h = 0; h < heads; ++h)
      add_weighted_rows(acc + h * d, scores + h * ctx + t0, v + h / group * d, token_numel, n, d);
  });
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < d; ++i) out[h * out_head_stride + i] = static_cast<T>(acc[h * d + i] * inv_sum[h]);
}

// Each decode row in `decodes` (batch indices, longest first), each to the next free thread: the rows' lengths
// differ by 10x and more.
template <typename T, typename C>
void decode_rows(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& tables, const int64_t* start, const int64_t* len,
                 const std::vector<int64_t>& decodes, float scale, float v_scale) {
  const int64_t n = decodes.size();
#pragma omp parallel num_threads(at::get_num_threads()) if (n > 1)
  {
    std::vector<float> work;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = decodes[i], row = start[b];
      const PagedCache cache{k_cache.size(1), k_cache.size(2), k_cache.size(3),
                             tables.data_ptr<int32_t>() + b * tables.size(1)};
      decode_one<T, C>(out.data_ptr<T>() + row * out.stride(0), out.stride(1), q.data_ptr<T>() + row * q.stride(0),
                       q.stride(1), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), cache, q.size(1), len[b], scale,
                       v_scale, work);
    }
  }
}

// out[query_start_loc[b]] for every sequence b with one query token (the others, prefills, are left alone).
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                            double k_scale, double v_scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.sizes() == q.sizes() && out.stride(2) == 1 &&
              out.scalar_type() == q.scalar_type(), "q, out: [tokens, heads, head_dim], the last dim contiguous");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type() &&
              (fp8 || k_cache.scalar_type() == q.scalar_type()), "k_cache, v_cache: contiguous, of q's dtype or fp8");
  const auto tables = block_tables.to(at::kInt).contiguous();
  const auto starts = query_start_loc.to(at::kLong).contiguous();
  const auto lens = seq_lens.to(at::kLong).contiguous();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t width = tables.size(1), block_size = k_cache.size(1);
  TORCH_CHECK(starts.numel() == lens.numel() + 1 && tables.size(0) >= lens.numel() &&
              q.size(1) % k_cache.size(2) == 0,
              "query_start_loc: [batch + 1]; block_tables: [batch, width]; heads: a multiple of kv_heads");
  std::vector<int64_t> decodes;
  for (int64_t b = 0; b < lens.numel(); ++b) {
    if (start[b + 1] - start[b] != 1 || len[b] == 0) continue;
    TORCH_CHECK(len[b] <= width * block_size, "seq_lens[", b, "] is past its block table's ", width, " blocks");
    decodes.push_back(b);
  }
  std::sort(decodes.begin(), decodes.end(), [&](int64_t a, int64_t b) { return len[a] > len[b]; });
  const float unit = fp8 ? kFp8Unit : 1.f;
  const float q_scale = static_cast<float>(scale * k_scale) * unit, out_scale = static_cast<float>(v_scale) * unit;
  DISPATCH_FLOATS(q.scalar_type(), "paged_decode_attention", [&] {
    if (fp8)
      decode_rows<scalar_t, Fp8>(out, q, k_cache, v_cache, tables, start, len, decodes, q_scale, out_scale);
    else
      decode_rows<scalar_t, scalar_t>(out, q, k_cache, v_cache, tables, start, len, decodes, q_scale, out_scale);
  });
}

// One token's x [kv_heads, head_dim] (rows of stride `row_stride`) into its cache slot, as reference.to_cache
// stores it: x itself, or fp8 of x / scale, saturated at fp8's largest value.
template <typename T, typename C>
void store_token(C* slot, const T* x, int64_t row_stride, int64_t heads, int64_t d, float scale) {
  const float top = static_cast<float>(std::numeric_limits<Fp8>::max());
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < d; ++i) {
      if constexpr (std::is_same_v<C, Fp8>)
        slot[h * d + i] = Fp8(std::clamp(static_cast<float>(x[h * row_stride + i]) / scale, -top, top));
      else
        slot[h * d + i] = x[h * row_stride + i];
    }
}

// store_kvcache_ref for slots that are all valid: k, v [T, kv_heads, head_dim] (the last dim contiguous) into
// k_cache, v_cache [blocks, block_size, kv_heads, head_dim] at slot_mapping [T], in x's dtype or fp8.
void store_kvcache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
              v.scalar_type() == k.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.scalar_type() == k_cache.scalar_type() && (fp8 || k_cache.scalar_type() == k.scalar_type()) &&
              k_cache.dim() == 4 && k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2) &&
              slot_mapping.numel() == k.size(0),
              "k, v: [T, kv_heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim] of k's dtype or fp8");
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t tokens = k.size(0), heads = k.size(1), d = k.size(2), capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot_mapping out of range");
  DISPATCH_FLOATS(k.scalar_type(), "store_kvcache", [&] {
    const auto run = [&](auto* k_out, auto* v_out) {
      using C = std::remove_pointer_t<decltype(k_out)>;
      for (int64_t t = 0; t < tokens; ++t) {
        store_token<scalar_t, C>(k_out + slot[t] * heads * d, k.data_ptr<scalar_t>() + t * k.stride(0), k.stride(1),
                                 heads, d, static_cast<float>(k_scale));
        store_token<scalar_t, C>(v_out + slot[t] * heads * d, v.data_ptr<scalar_t>() + t * v.stride(0), v.stride(1),
                                 heads, d, static_cast<float>(v_scale));
      }
    };
    if (fp8)
      run(k_cache.data_ptr<Fp8>(), v_cache.data_ptr<Fp8>());
    else
      run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
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
      for (int64_t i = 0; i < n; ++i)
        out[r * n + i] = static_cast<T>(round_to<T>(f32(xr[i]) * inv_rms) * f32(weight[i]));
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
  DISPATCH_FLOATS(x.scalar_type(), "rms_norm", [&] {
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
  DISPATCH_FLOATS(x.scalar_type(), "fused_add_rms_norm", [&] {
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
              k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.scalar_type() == q.scalar_type(),
              "q, k: [tokens, heads, head_dim] of one dtype, tokens and head_dim alike");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == q.size(0) && cos.size(1) * 2 == q.size(2),
              "cos, sin: [tokens, head_dim / 2]");
  const auto cos32 = cos.to(at::kFloat).contiguous(), sin32 = sin.to(at::kFloat).contiguous();
  auto q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  DISPATCH_FLOATS(q.scalar_type(), "rotary", [&] {
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
  DISPATCH_FLOATS(x.scalar_type(), "silu_and_mul", [&] {
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

// Activations as int8 digits: one, c = round(x * 127 / max |x|), or two, an int16 code c = round(x * kTop2 / max |x|)
// split into c = 256 hi + lo, hi and lo in [-128, 127], so that int8 GEMMs multiply them (quantize_rows_ref).
constexpr int kTop2 = 127 * 256 + 127;  // the largest two-digit code whose hi = floor((c + 128) / 256) is <= 127

// One row of x [k] as its digits (hi, and lo where digits == 2); returns the row's scale, max |x| / the largest
// code.
template <typename T>
float quantize_row(int8_t* hi, int8_t* lo, const T* x, float* buf, int64_t k, int64_t digits) {
  const float* xr = as_float(x, buf, k);
  float top = 0.f;
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < k; ++i) top = std::max(top, std::abs(xr[i]));
  const float top_code = digits == 1 ? 127.f : static_cast<float>(kTop2);
  const float inv = top > 0.f ? top_code / top : 0.f;
  // at::vec's round (to nearest even, one instruction), which -ffast-math leaves as it is
  float rounded[kWidth];
  for (int64_t i = 0; i < k; i += kWidth) {
    const int64_t count = std::min(kWidth, k - i);
    (Vec::loadu(xr + i, count) * Vec(inv)).round().store(rounded, count);
    for (int64_t j = 0; j < count; ++j) {
      const int code = static_cast<int>(rounded[j]);
      const int high = digits == 1 ? code : (code + 128) >> 8;  // an arithmetic shift: floor
      hi[i + j] = static_cast<int8_t>(high);
      if (digits == 2) lo[i + j] = static_cast<int8_t>(code - (high << 8));
    }
  }
  return top / top_code;
}

// out[j] = (the row's code . w[j]) * row_scale * scales[j], in out's dtype: the code's sums are hi's, or
// 256 hi's + lo's (lo: nullptr for one digit)
template <typename T, typename S>
void scale_row(T* out, const int32_t* hi, const int32_t* lo, float row_scale, const S* scales, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t sum = lo == nullptr ? hi[j] : int64_t(hi[j]) * 256 + lo[j];
    out[j] = static_cast<T>(static_cast<float>(sum) * row_scale * static_cast<float>(scales[j]));
  }
}

// w8a8_linear_ref: each row of x [T, K] quantized with its own scale to `digits` int8 digits (1: int8, 2: int16
// as two int8 halves), int8 x int8 -> int32 matmuls of the digits against qweight [N, K] by oneDNN's GEMM (through
// at::_int_mm, which reads the plain weight), then y = the code's sums * row scale * scales [N] (float32 or
// bfloat16), in x's dtype. Exact only where oneDNN has VNNI: without it, its GEMM saturates
// (layers/quantization.py's exact_int8_gemm gates the callers).
at::Tensor w8a8_linear(const at::Tensor& x_in, const at::Tensor& qweight_in, const at::Tensor& scales_in,
                       int64_t digits) {
  TORCH_CHECK(x_in.dim() == 2 && qweight_in.dim() == 2 && qweight_in.scalar_type() == at::kChar &&
              qweight_in.size(1) == x_in.size(1) && scales_in.numel() == qweight_in.size(0) &&
              (scales_in.scalar_type() == at::kFloat || scales_in.scalar_type() == at::kBFloat16),
              "x: [T, K]; qweight: [N, K] int8; scales: [N] float32 or bfloat16");
  TORCH_CHECK(digits == 1 || digits == 2, "digits: 1 or 2");
  const auto x = x_in.contiguous(), qweight = qweight_in.contiguous(), scales = scales_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = qweight.size(0), code_rows = digits * rows;
  auto codes = at::empty({code_rows, k}, x.options().dtype(at::kChar));
  std::vector<float> row_scale(rows), buf(k);
  DISPATCH_FLOATS(x.scalar_type(), "w8a8_linear", [&] {
    int8_t* c = codes.data_ptr<int8_t>();
    for (int64_t r = 0; r < rows; ++r)
      row_scale[r] = quantize_row(c + r * k, c + (rows + r) * k, x.data_ptr<scalar_t>() + r * k, buf.data(), k,
                                  digits);
  });
  const at::Tensor sums = at::_int_mm(codes, qweight.t());
  auto out = at::empty({rows, n}, x.options());
  DISPATCH_FLOATS(x.scalar_type(), "w8a8_linear", [&] {
    for (int64_t r = 0; r < rows; ++r) {
      scalar_t* o = out.data_ptr<scalar_t>() + r * n;
      const int32_t* hi = sums.data_ptr<int32_t>() + r * n;
      const int32_t* lo = digits == 1 ? nullptr : sums.data_ptr<int32_t>() + (rows + r) * n;
      if (scales.scalar_type() == at::kFloat)
        scale_row(o, hi, lo, row_scale[r], scales.data_ptr<float>(), n);
      else
        scale_row(o, hi, lo, row_scale[r], scales.data_ptr<c10::BFloat16>(), n);
    }
  });
  return out;
}


#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BW__) && defined(__AVX512DQ__)
// 4-bit weights in groups of kGroup inputs, w = q * scale + offset (q in [0, 15]), float32 scale and offset per
// group. A row's codes are packed two a byte in chunks of kChunk (reference.pack_int4_chunks): byte b of chunk c
// holds code kChunk c + b in its low nibble and code kChunk c + kGroup + b in its high one, so that one 32-byte load
// holds a chunk's two groups in order. Two kernels read that layout (torch's int4 kernel instead reads and
// dequantizes the weight again for every row of x):
// - int4_linear_amx, for many rows: each group of 16 output channels is dequantized once per pass (64 rows of x)
//   to bfloat16 in a 1 KB tile (AMX's A operand: channels x kGroup inputs) and multiplied into every block of 16
//   rows of x (the B operand, rearranged once per call into AMX's pairs layout), float32 sums in the C tiles;
// - int4_linear_vnni, for few rows: x as int16 codes in two int8 digits (quantize_row), VNNI's u8 x s8 dot products
//   of the codes as they are, each group's integer sum scaled as it is made; the offsets' part, offset times the
//   group's code sum, is one small float GEMM beside.
constexpr int64_t kGroup = 32;     // inputs per group, and per tile product (16 pairs of bfloat16)
constexpr int64_t kChunk = 2 * kGroup;
constexpr int64_t kTile = 16;      // channels per A tile, rows of x per B tile
constexpr int64_t kTokenBlocks = 4;  // C tiles (tmm2..tmm5): 64 rows of x per pass over the weight

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// every tile 16 rows of 64 bytes: tmm0 A (16 channels x 32 bfloat16), tmm1 B (16 pairs x 16 rows of x x 2
// bfloat16), tmm2..5 C (16 channels x 16 rows of x, float32)
inline void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 2 + kTokenBlocks; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// Linux gives a process AMX's tile state only once asked (as oneDNN asks for torch's own AMX kernels)
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

// group g of one channel (its codes: the channel's packed row) as 32 bfloat16 weights, stored at out
inline void dequantize_group(c10::BFloat16* out, const uint8_t* codes, int64_t g, float scale, float offset) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g / 2 * kGroup));
  const __m256i group = _mm256_and_si256(g % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0F));
  const __m512 s = _mm512_set1_ps(scale), o = _mm512_set1_ps(offset);
  const __m512 first = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(group))), s, o);
  const __m512 second =
      _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(group, 1))), s, o);
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(second, first));  // first in the low half
}

// x [rows, k] as bfloat16 B tiles: for each group g and block of 16 rows b, 16 pairs p x 16 rows t x 2, x[t][32 g +
// 2 p + e] at ((g * blocks + b) * 16 + p) * 32 + 2 t + e; rows past the end are zeros
std::vector<c10::BFloat16> pair_tiles(const c10::BFloat16* x, int64_t rows, int64_t k, int64_t blocks) {
  std::vector<c10::BFloat16> tiles(k / kGroup * blocks * kTile * 2 * kTile, c10::BFloat16(0.f));
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < k; ++i) {
      const int64_t g = i / kGroup, p = (i % kGroup) / 2, b = t / kTile;
      tiles[((g * blocks + b) * kTile + p) * 2 * kTile + 2 * (t % kTile) + i % 2] = x[t * k + i];
    }
  return tiles;
}

// sums [rows, n] for 16 channels from j (codes, scale, offset: theirs) and up to kTokenBlocks blocks of x's rows
void amx_channel_block(float* sums, int64_t n, int64_t rows, int64_t blocks, const c10::BFloat16* tiles,
                       const uint8_t* codes, const float* scale, const float* offset, int64_t k) {
  alignas(64) c10::BFloat16 weights[kTile * kGroup];
  alignas(64) float out[kTile * kTile];
  const int64_t groups = k / kGroup;
  _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t c = 0; c < kTile; ++c)
      dequantize_group(weights + c * kGroup, codes + c * (k / 2), g, scale[c * groups + g], offset[c * groups + g]);
    _tile_loadd(0, weights, 64);
    const c10::BFloat16* b = tiles + g * blocks * kTile * 2 * kTile;
    // (tile numbers are immediates: one case per C tile)
    _tile_loadd(1, b, 64); _tile_dpbf16ps(2, 0, 1);
    if (blocks > 1) { _tile_loadd(1, b + 1 * kTile * 2 * kTile, 64); _tile_dpbf16ps(3, 0, 1); }
    if (blocks > 2) { _tile_loadd(1, b + 2 * kTile * 2 * kTile, 64); _tile_dpbf16ps(4, 0, 1); }
    if (blocks > 3) { _tile_loadd(1, b + 3 * kTile * 2 * kTile, 64); _tile_dpbf16ps(5, 0, 1); }
  }
  for (int64_t blk = 0; blk < blocks; ++blk) {
    switch (blk) {
      case 0: _tile_stored(2, out, 64); break;
      case 1: _tile_stored(3, out, 64); break;
      case 2: _tile_stored(4, out, 64); break;
      default: _tile_stored(5, out, 64);
    }
    for (int64_t t = 0; t < kTile && blk * kTile + t < rows; ++t)
      for (int64_t c = 0; c < kTile; ++c) sums[(blk * kTile + t) * n + c] = out[c * kTile + t];
  }
}

// reference.int4_linear_bf16_ref: x rounded to bfloat16, the weight dequantized to bfloat16, float32 sums
at::Tensor int4_linear_amx(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                           const at::Tensor& offset) {
  TORCH_CHECK(amx_permitted(), "int4_linear: this process may not use AMX (arch_prctl XTILEDATA refused)");
  const auto x = x_in.to(at::kBFloat16).contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0), groups = k / kGroup;
  auto sums = at::empty({rows, n}, x.options().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float *sc = scale.data_ptr<float>(), *of = offset.data_ptr<float>();
  for (int64_t first_row = 0; first_row < rows; first_row += kTokenBlocks * kTile) {
    const int64_t pass_rows = std::min(kTokenBlocks * kTile, rows - first_row);
    const int64_t blocks = (pass_rows + kTile - 1) / kTile;
    const auto tiles = pair_tiles(x.data_ptr<c10::BFloat16>() + first_row * k, pass_rows, k, blocks);
    float* out = sums.data_ptr<float>() + first_row * n;
    at::parallel_for(0, n / kTile, 4, [&](int64_t begin, int64_t end) {
      load_tile_config();
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t j = blk * kTile;
        amx_channel_block(out + j, n, pass_rows, blocks, tiles.data(), w + j * (k / 2), sc + j * groups,
                          of + j * groups, k);
      }
      _tile_release();
    });
  }
  return sums;
}

constexpr int64_t kVnniRows = 4;  // rows per pass of int4_linear_vnni: 4 x 2 accumulators, 2 weight and 2 scale vectors
constexpr int64_t kInt4VnniMaxRows = 4;  // more rows: int4_linear_amx (client/bench_quant.py)

inline __m512i unpack_chunk(const uint8_t* packed) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i low = _mm256_and_si256(bytes, nibble), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

// out[r * n + c] += sum over groups of scale * (256 q . hi + q . lo), for R rows of digits (hi, lo: [R, k]) and C
// output channels (packed: [C, k / 2], scale: [C, k / kGroup]); a dot product's lanes 0-7 sum a chunk's first
// group, 8-15 its second
template <int64_t R, int64_t C>
void vnni_int4_block(float* out, int64_t n, const int8_t* hi, const int8_t* lo, const uint8_t* packed,
                     const float* scale, int64_t k) {
  __m512 acc[R][C];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t groups = k / kGroup;
  for (int64_t i = 0; i < k; i += kChunk) {
    __m512i wv[C];
    __m512 sv[C];
    for (int64_t c = 0; c < C; ++c) {
      wv[c] = unpack_chunk(packed + c * (k / 2) + i / 2);
      const float* s = scale + c * groups + i / kGroup;
      sv[c] = _mm512_insertf32x8(_mm512_set1_ps(s[0]), _mm256_set1_ps(s[1]), 1);
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m512i h = _mm512_loadu_si512(hi + r * k + i), l = _mm512_loadu_si512(lo + r * k + i);
      for (int64_t c = 0; c < C; ++c) {
        const __m512i high = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[c], h), 8);
        const __m512i sums = _mm512_dpbusd_epi32(high, wv[c], l);  // 256 q . hi + q . lo, per half group
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), sv[c], acc[r][c]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) out[r * n + c] += _mm512_reduce_add_ps(acc[r][c]);
}

template <int64_t C>
void vnni_int4_channels(float* out, int64_t n, const int8_t* hi, const int8_t* lo, int64_t rows,
                        const uint8_t* packed, const float* scale, int64_t k) {
  for (int64_t r = 0; r < rows; r += kVnniRows) {
    float* o = out + r * n;
    const int8_t *h = hi + r * k, *l = lo + r * k;
    switch (std::min(kVnniRows, rows - r)) {
      case 1: vnni_int4_block<1, C>(o, n, h, l, packed, scale, k); break;
      case 2: vnni_int4_block<2, C>(o, n, h, l, packed, scale, k); break;
      case 3: vnni_int4_block<3, C>(o, n, h, l, packed, scale, k); break;
      default: vnni_int4_block<4, C>(o, n, h, l, packed, scale, k);
    }
  }
}

// reference.int4_linear_int16_ref: x quantized per row to int16 codes (quantize_rows_ref, digits=2), row scale *
// (sum over groups of scale * codes . q + offset * the group's code sum)
at::Tensor int4_linear_vnni(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                            const at::Tensor& offset) {
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0), groups = k / kGroup;
  auto digits = at::empty({2, rows, k}, x.options().dtype(at::kChar));
  int8_t *hi = digits.data_ptr<int8_t>(), *lo = hi + rows * k;
  auto code_sums = at::empty({rows, groups}, x.options().dtype(at::kFloat));  // exact: |sum| < 2^21
  std::vector<float> row_scale(rows), buf(k);
  DISPATCH_FLOATS(x.scalar_type(), "int4_linear", [&] {
    for (int64_t r = 0; r < rows; ++r) {
      row_scale[r] = quantize_row(hi + r * k, lo + r * k, x.data_ptr<scalar_t>() + r * k, buf.data(), k, 2);
      for (int64_t g = 0; g < groups; ++g) {
        int32_t sum = 0;
        for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) sum += 256 * hi[r * k + i] + lo[r * k + i];
        code_sums.data_ptr<float>()[r * groups + g] = static_cast<float>(sum);
      }
    }
  });
  auto sums = at::mm(code_sums, offset.t()).contiguous();  // the offsets' part, [T, N]
  float* s = sums.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* sc = scale.data_ptr<float>();
  at::parallel_for(0, n / 2, 16, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      vnni_int4_channels<2>(s + 2 * p, n, hi, lo, rows, w + 2 * p * (k / 2), sc + 2 * p * groups, k);
  });
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) s[r * n + j] *= row_scale[r];
  return sums;
}

// x [T, K] @ the 4-bit weight packed [N, K / 2] (pack_int4_chunks) with float32 scale and offset [N, K / 32],
// in x's dtype: up to kInt4VnniMaxRows rows by int4_linear_vnni, more by int4_linear_amx. K: a
// multiple of 64; N: of 16.
at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& packed_in, const at::Tensor& scale_in,
                       const at::Tensor& offset_in) {
  TORCH_CHECK(x_in.dim() == 2 && packed_in.dim() == 2 && packed_in.scalar_type() == at::kByte &&
              x_in.size(1) % kChunk == 0 && packed_in.size(1) * 2 == x_in.size(1) && packed_in.size(0) % kTile == 0 &&
              scale_in.scalar_type() == at::kFloat && offset_in.scalar_type() == at::kFloat &&
              scale_in.sizes() == offset_in.sizes() && scale_in.dim() == 2 &&
              scale_in.size(0) == packed_in.size(0) && scale_in.size(1) * kGroup == x_in.size(1),
              "x: [T, K], K a multiple of 64; packed: [N, K / 2] uint8, N a multiple of 16; scale, offset: [N, K / 32] "
              "float32");
  const auto x = x_in.contiguous(), packed = packed_in.contiguous();
  const auto scale = scale_in.contiguous(), offset = offset_in.contiguous();
  const auto sums = x.size(0) <= kInt4VnniMaxRows ? int4_linear_vnni(x, packed, scale, offset)
                                                  : int4_linear_amx(x, packed, scale, offset);
  return sums.to(x_in.scalar_type());
}
#define NANOSERVE_INT4_LINEAR 1
#endif


#if defined(__AVX2__) && defined(__FMA__)
// Activations in blocks, as llama.cpp's Q8_0 but in int16 codes: each row of x in groups of kBlock inputs, each group
// with its own scale d = max |x| / kTop2, so that an outlier coarsens only its own group (one scale per row rounds a
// row with SmolLM2's outlier channels to a few codes). Each group's integer sum is exact (AVX2's int16 pair products,
// madd) and scaled as it is made:
// - int4_block_linear: 4-bit weights in pack_int4_interleaved's layout, w = q * scale + offset per group; the
//   offsets' part adds offset times the group's exact sum of x.
// - int8_block_linear: int8 weights with one scale per output channel, applied at the end.
// int8 codes (llama.cpp's Q4 x Q8 and Q8 x Q8) tripled SmolLM2's teacher-forced logprob error against the float
// engine's and flipped the demo's answer; int16 ones are within torch's weight-only kernel's.
// Each tile of channels' weights is loaded once for several rows (for_tiles).
constexpr int64_t kBlock = 32;
constexpr int64_t kInterleave = 8;      // int4_block_linear: channels per block of pack_int4_interleaved
constexpr int64_t kInt4BlockRows = 6;   // rows per pass over a block (client/bench_quant.py: 6 beat 4 and 8)
constexpr int64_t kTileChannels = 16;   // int8_block_linear: channels per tile
constexpr int64_t kInt8BlockRows = 4;   // rows per pass over a tile

struct Blocks {
  at::Tensor codes;           // [T, K] int16
  at::Tensor scales, sums;    // [T, K / kBlock] float32: each group's d and its sum of x
};

template <typename T>
void quantize_block_row(int16_t* codes, float* scales, float* sums, const T* x, float* buf, int64_t k) {
  const float* xr = as_float(x, buf, k);
  const float top_code = static_cast<float>(kTop2);
  for (int64_t g = 0; g < k / kBlock; ++g) {
    const float* xg = xr + g * kBlock;
    float top = 0.f, sum = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) top = std::max(top, std::abs(xg[i])), sum += xg[i];
    const __m256 inv = _mm256_set1_ps(top > 0.f ? top_code / top : 0.f);
    for (int64_t i = 0; i < kBlock; i += 8) {  // round to nearest even, as torch.round
      alignas(32) int32_t rounded[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(rounded),
                         _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xg + i), inv),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      for (int64_t j = 0; j < 8; ++j) codes[g * kBlock + i + j] = static_cast<int16_t>(rounded[j]);
    }
    scales[g] = top / top_code, sums[g] = sum;
  }
}

Blocks quantize_blocks(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kBlock;
  const auto floats = x.options().dtype(at::kFloat);
  Blocks b{at::empty({rows, k}, x.options().dtype(at::kShort)),
           at::empty({rows, groups}, floats), at::empty({rows, groups}, floats)};
  DISPATCH_FLOATS(x.scalar_type(), "quantize_blocks", [&] {
    std::vector<float> buf(k);
    for (int64_t r = 0; r < rows; ++r)
      quantize_block_row(b.codes.data_ptr<int16_t>() + r * k, b.scales.data_ptr<float>() + r * groups,
                         b.sums.data_ptr<float>() + r * groups, x.data_ptr<scalar_t>() + r * k, buf.data(), k);
  });
  return b;
}

inline float hsum(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

inline __m256i load_codes(const int16_t* codes) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)); }

// 16 int8 weights as int16
inline __m256i widened(const int8_t* w) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}

// two int16 codes, x[0] and x[1], in each 32-bit lane
inline __m256i pair_in_every_lane(const int16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof pair);
  return _mm256_set1_epi32(pair);
}

// 8 group scales or offsets as float32: held as float32, or as float16 (a GGUF file's, exactly, in fewer bytes)
inline __m256 load_group(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load_group(const c10::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}

// The hardware prefetchers alone kept a one-row pass over the weights at about half the rate it reached from cache
// (Zen 4): asking for the lines 16 groups ahead made a one-row step's int4 matmuls 20-25% faster (1.5 and 3 KB
// ahead were no better, 4 KB was slower).
constexpr int64_t kPrefetchBytes = 2048;

// one group's 128 bytes of a block (kBlock * kInterleave / 2), into L1
inline void prefetch_group(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + 64), _MM_HINT_T0);
}

// out[r * n + 8 b + c] for the 8 channels c of channel block b and R rows of int16 block codes (with their d and
// sums): over groups g, scale[b, g, c] * d[r, g] * (q . codes) + offset[b, g, c] * sums[r, g]. In
// pack_int4_interleaved's layout each 16 bytes hold two input pairs of all 8 channels (one madd's worth), so that
// each product lands in its own channel's lane: no horizontal sums, and one conversion and scaling per group for 8
// channels. Channels past n (the last block's padding) are not written.
template <int64_t R, typename S>
void int4_block_rows(float* out, int64_t n, const int16_t* codes, const float* d, const float* sums,
                     const uint8_t* packed, const S* scale, const S* offset, int64_t k, int64_t b) {
  const int64_t groups = k / kBlock;
  const uint8_t* w = packed + b * groups * kBlock * kInterleave / 2;
  const S *sc = scale + b * groups * kInterleave, *of = offset + b * groups * kInterleave;
  __m256 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, w += kBlock * kInterleave / 2) {
    prefetch_group(w + kPrefetchBytes);
    __m256i exact[R];
    for (int64_t r = 0; r < R; ++r) exact[r] = _mm256_setzero_si256();
    for (int64_t j = 0; j < kBlock / 4; ++j) {  // the pairs 2j, 2j + 1 (low nibbles) and 16 + 2j, 17 + 2j (high)
      const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * j)));
      const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)), high = _mm256_srli_epi16(bytes, 4);
      for (int64_t r = 0; r < R; ++r) {
        const int16_t* x = codes + r * k + g * kBlock + 2 * j;
        exact[r] = _mm256_add_epi32(exact[r], _mm256_add_epi32(_mm256_madd_epi16(low, pair_in_every_lane(x)),
                                                               _mm256_madd_epi16(high, pair_in_every_lane(x + 16))));
      }
    }
    const __m256 group_scale = load_group(sc + g * kInterleave), group_offset = load_group(of + g * kInterleave);
    for (int64_t r = 0; r < R; ++r) {
      const __m256 both_scales = _mm256_mul_ps(group_scale, _mm256_set1_ps(d[r * groups + g]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact[r]), both_scales, acc[r]);
      acc[r] = _mm256_fmadd_ps(group_offset, _mm256_set1_ps(sums[r * groups + g]), acc[r]);
    }
  }
  const int64_t first = b * kInterleave, count = std::min(kInterleave, n - first);
  for (int64_t r = 0; r < R; ++r) {
    alignas(32) float lanes[kInterleave];
    _mm256_store_ps(lanes, acc[r]);
    std::copy(lanes, lanes + count, out + r * n + first);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// AVX-512 VNNI: int4_block_rows over two channel blocks at once, b in the low half of each register and b + 1 in the
// high half, so that each broadcast pair of x serves 16 channels, and VNNI's dpwssd adds the pair products into the
// sums. The same layout and the same sums in the same order as int4_block_rows, so the results are equal. On Zen 4
// it is faster from 7 rows (about 1.2x at 16, 1.3x at 64) and slower below, where reading two blocks' streams at
// once costs more than the instructions saved.
constexpr int64_t kInt4WideRows = 8;     // rows per pass over a block pair (client/bench_quant.py)
constexpr int64_t kInt4WideMinRows = 7;  // fewer: int4_block_rows, one block at a time, is as fast or faster

inline __m512 load_group_pair(const float* low, const float* high) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(low)), _mm256_loadu_ps(high), 1);
}
inline __m512 load_group_pair(const c10::Half* low, const c10::Half* high) {
  return _mm512_cvtph_ps(_mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(high),
                                             reinterpret_cast<const __m128i*>(low)));
}

template <int64_t R, typename S>
void int4_block_pair_rows(float* out, int64_t n, const int16_t* codes, const float* d, const float* sums,
                          const uint8_t* packed, const S* scale, const S* offset, int64_t k, int64_t b) {
  const int64_t groups = k / kBlock, block_bytes = groups * kBlock * kInterleave / 2;
  const uint8_t* w = packed + b * block_bytes;
  const S *sc = scale + b * groups * kInterleave, *of = offset + b * groups * kInterleave;
  const int64_t next = groups * kInterleave;  // block b + 1's scales and offsets
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  constexpr int64_t chains = R >= 4 ? 2 : 8 / R;  // sums per row: for few rows dpwssd's latency binds, not its rate
  for (int64_t g = 0; g < groups; ++g, w += kBlock * kInterleave / 2) {
    prefetch_group(w + kPrefetchBytes), prefetch_group(w + block_bytes + kPrefetchBytes);
    __m512i partial[R][chains];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < chains; ++c) partial[r][c] = _mm512_setzero_si512();
    for (int64_t j = 0; j < kBlock / 4; ++j) {
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu2_m128i(
          reinterpret_cast<const __m128i*>(w + block_bytes + 16 * j), reinterpret_cast<const __m128i*>(w + 16 * j)));
      const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F)), high = _mm512_srli_epi16(bytes, 4);
      const int64_t c = (2 * j) % chains;
      for (int64_t r = 0; r < R; ++r) {
        const int16_t* x = codes + r * k + g * kBlock + 2 * j;
        int32_t pair, pair16;
        std::memcpy(&pair, x, sizeof pair), std::memcpy(&pair16, x + 16, sizeof pair16);
        partial[r][c] = _mm512_dpwssd_epi32(partial[r][c], low, _mm512_set1_epi32(pair));
        partial[r][c + 1] = _mm512_dpwssd_epi32(partial[r][c + 1], high, _mm512_set1_epi32(pair16));
      }
    }
    __m512i exact[R];
    for (int64_t r = 0; r < R; ++r) {
      exact[r] = partial[r][0];
      for (int64_t c = 1; c < chains; ++c) exact[r] = _mm512_add_epi32(exact[r], partial[r][c]);
    }
    const S *scale_g = sc + g * kInterleave, *offset_g = of + g * kInterleave;
    const __m512 group_scale = load_group_pair(scale_g, scale_g + next);
    const __m512 group_offset = load_group_pair(offset_g, offset_g + next);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 both_scales = _mm512_mul_ps(group_scale, _mm512_set1_ps(d[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact[r]), both_scales, acc[r]);
      acc[r] = _mm512_fmadd_ps(group_offset, _mm512_set1_ps(sums[r * groups + g]), acc[r]);
    }
  }
  const int64_t first = b * kInterleave, count = std::min(2 * kInterleave, n - first);
  for (int64_t r = 0; r < R; ++r) {
    alignas(64) float lanes[2 * kInterleave];
    _mm512_store_ps(lanes, acc[r]);
    std::copy(lanes, lanes + count, out + r * n + first);
  }
}
#define NANOSERVE_INT4_WIDE 1
#endif

// out[r * n + c] = scales[c] * sum over groups of d[r, g] * (w . codes), for R rows of int16 block codes (with their
// d) and the channels c in [first, last)
template <int64_t R, typename S>
void int8_rows(float* out, int64_t n, const int16_t* codes, const float* d, const int8_t* qweight, const S* scales,
               int64_t k, int64_t first, int64_t last) {
  const int64_t groups = k / kBlock;
  for (int64_t c = first; c < last; ++c) {
    const int8_t* w = qweight + c * k;
    __m256 acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m256i low = widened(w + g * kBlock), high = widened(w + g * kBlock + 16);
      for (int64_t r = 0; r < R; ++r) {
        const int16_t* x = codes + r * k + g * kBlock;
        const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(low, load_codes(x)),
                                             _mm256_madd_epi16(high, load_codes(x + 16)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d[r * groups + g]), acc[r]);
      }
    }
    for (int64_t r = 0; r < R; ++r) out[r * n + c] = hsum(acc[r]) * static_cast<float>(scales[c]);
  }
}

// run(R, first row, first tile) over every row and tile of channels: tiles across threads, each tile's rows
// MaxRows at a time (a tile's weights stay in L1 across them)
template <int64_t MaxRows, int64_t R = MaxRows, typename Run>
void run_rows(int64_t count, int64_t r, int64_t t, const Run& run) {
  if constexpr (R > 1) {
    if (count < R) return run_rows<MaxRows, R - 1>(count, r, t, run);
  }
  run(std::integral_constant<int64_t, R>{}, r, t);
}

template <int64_t MaxRows, typename Run>
void for_tiles(int64_t rows, int64_t tiles, int64_t tile_work, const Run& run) {
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / (tile_work * rows));
  at::parallel_for(0, tiles, grain, [&](int64_t first_tile, int64_t last_tile) {
    for (int64_t t = first_tile; t < last_tile; ++t)
      for (int64_t r = 0; r < rows; r += MaxRows) run_rows<MaxRows>(std::min(MaxRows, rows - r), r, t, run);
  });
}

// reference.int4_block_linear_ref: x [T, K] in int16 blocks @ the 4-bit weight of out_features channels in
// pack_int4_interleaved's layout (packed [B, K * 4] uint8; scale and offset [B, K / 4] float32 or both float16, by
// interleave_groups; B = ceil(out_features / 8)), in x's dtype. K: a multiple of 32.
at::Tensor int4_block_linear(const at::Tensor& x_in, const at::Tensor& packed_in, const at::Tensor& scale_in,
                             const at::Tensor& offset_in, int64_t out_features) {
  const int64_t blocks = (out_features + kInterleave - 1) / kInterleave;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % kBlock == 0 && out_features > 0 &&
              packed_in.scalar_type() == at::kByte && packed_in.sizes() == at::IntArrayRef({blocks, x_in.size(1) * 4}) &&
              (scale_in.scalar_type() == at::kFloat || scale_in.scalar_type() == at::kHalf) &&
              offset_in.scalar_type() == scale_in.scalar_type() && scale_in.sizes() == offset_in.sizes() &&
              scale_in.sizes() == at::IntArrayRef({blocks, x_in.size(1) / 4}),
              "x: [T, K], K a multiple of 32; packed: [ceil(out_features / 8), K * 4] uint8; scale, offset: "
              "[ceil(out_features / 8), K / 4], both float32 or both float16");
  const auto x = x_in.contiguous(), packed = packed_in.contiguous();
  const auto scale = scale_in.contiguous(), offset = offset_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = out_features, groups = k / kBlock;
  const Blocks b = quantize_blocks(x);
  auto out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int16_t* codes = b.codes.data_ptr<int16_t>();
  const float *d = b.scales.data_ptr<float>(), *sums = b.sums.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const auto run_narrow = [&](const auto* sc, const auto* of) {
    for_tiles<kInt4BlockRows>(rows, blocks, kInterleave * k, [&](auto R, int64_t r, int64_t block) {
      int4_block_rows<decltype(R)::value>(o + r * n, n, codes + r * k, d + r * groups, sums + r * groups, w, sc, of,
                                          k, block);
    });
  };
#ifdef NANOSERVE_INT4_WIDE
  // tiles of two blocks, an odd last block alone; fewer rows read the weights faster one block at a time
  const auto run = [&](const auto* sc, const auto* of) {
    if (rows < kInt4WideMinRows) return run_narrow(sc, of);
    for_tiles<kInt4WideRows>(rows, (blocks + 1) / 2, 2 * kInterleave * k, [&](auto R, int64_t r, int64_t pair) {
      constexpr int64_t rows_now = decltype(R)::value;
      const int64_t block = 2 * pair;
      if (block + 1 < blocks)
        int4_block_pair_rows<rows_now>(o + r * n, n, codes + r * k, d + r * groups, sums + r * groups, w, sc, of, k,
                                       block);
      else
        int4_block_rows<rows_now>(o + r * n, n, codes + r * k, d + r * groups, sums + r * groups, w, sc, of, k, block);
    });
  };
#else
  const auto& run = run_narrow;
#endif
  if (scale.scalar_type() == at::kFloat)
    run(scale.data_ptr<float>(), offset.data_ptr<float>());
  else
    run(scale.data_ptr<c10::Half>(), offset.data_ptr<c10::Half>());
  return out.to(x_in.scalar_type());
}

// reference.int8_block_linear_ref: x [T, K] in int16 blocks @ (qweight [N, K] int8 * scales [N])^T, in x's dtype.
// K: a multiple of 32.
at::Tensor int8_block_linear(const at::Tensor& x_in, const at::Tensor& qweight_in, const at::Tensor& scales_in) {
  TORCH_CHECK(x_in.dim() == 2 && qweight_in.dim() == 2 && qweight_in.scalar_type() == at::kChar &&
              qweight_in.size(1) == x_in.size(1) && x_in.size(1) % kBlock == 0 &&
              scales_in.numel() == qweight_in.size(0) &&
              (scales_in.scalar_type() == at::kFloat || scales_in.scalar_type() == at::kBFloat16),
              "x: [T, K], K a multiple of 32; qweight: [N, K] int8; scales: [N] float32 or bfloat16");
  const auto x = x_in.contiguous(), qweight = qweight_in.contiguous(), scales = scales_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = qweight.size(0), groups = k / kBlock;
  const Blocks b = quantize_blocks(x);
  auto out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int16_t* codes = b.codes.data_ptr<int16_t>();
  const int8_t* w = qweight.data_ptr<int8_t>();
  const float* d = b.scales.data_ptr<float>();
  const auto run = [&](const auto* channel_scales) {
    const int64_t tiles = (n + kTileChannels - 1) / kTileChannels;
    for_tiles<kInt8BlockRows>(rows, tiles, kTileChannels * k, [&](auto R, int64_t r, int64_t tile) {
      const int64_t first = tile * kTileChannels, last = std::min(n, first + kTileChannels);
      int8_rows<decltype(R)::value>(o + r * n, n, codes + r * k, d + r * groups, w, channel_scales, k, first, last);
    });
  };
  if (scales.scalar_type() == at::kFloat)
    run(scales.data_ptr<float>());
  else
    run(scales.data_ptr<c10::BFloat16>());
  return out.to(x_in.scalar_type());
}

// int8 weights where the CPU has VNNI (layers/quantization.py's runs_w8a8): up to kInt8BlockMaxRows rows by
// int8_block_linear, which streams the weight about 3x as fast as a VNNI matrix-vector kernel did on Zen 4; more
// by w8a8_linear's int16 codes per row and oneDNN's int8 GEMM (client/bench_quant.py).
constexpr int64_t kInt8BlockMaxRows = 8;

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  return x.dim() == 2 && x.size(0) <= kInt8BlockMaxRows && x.size(1) % kBlock == 0
             ? int8_block_linear(x, qweight, scales) : w8a8_linear(x, qweight, scales, 2);
}
#define NANOSERVE_BLOCK_LINEAR 1
#endif

// One decoder layer of a step in which every row decodes (one query token, a valid slot): what
// models/llama.py's LlamaDecoderLayer computes with the kernels above, in one call instead of a dozen ops and the
// Python between them (layers/decode_layer.py). Its four linear layers (qkv, o, gate_up, down) are quantized, each
// named by a LinearKernel, its three tensors and an int (out_features, or unused), with an optional bias;
// norms: the input and post-attention RMSNorms' weights, then (Qwen3) those of q and k per head.
enum LinearKernel : int64_t { kInt4BlockLinear = 0, kInt8BlockLinear = 1, kInt4Linear = 2, kInt8Linear = 3 };

at::Tensor quantized_linear(const at::Tensor& x, int64_t kernel, const at::Tensor* w, int64_t param) {
  switch (kernel) {
#ifdef NANOSERVE_BLOCK_LINEAR
    case kInt4BlockLinear: return int4_block_linear(x, w[0], w[1], w[2], param);
    case kInt8BlockLinear: return int8_block_linear(x, w[0], w[1]);
    case kInt8Linear: return int8_linear(x, w[0], w[1]);
#endif
#ifdef NANOSERVE_INT4_LINEAR
    case kInt4Linear: return int4_linear(x, w[0], w[1], w[2]);
#endif
    default: TORCH_CHECK(false, "decode_layer: linear kernel ", kernel, " is not built for this CPU");
  }
}

std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, double k_scale, double v_scale, const at::Tensor& slots,
    const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
    at::TensorList norms, double eps, at::IntArrayRef kernels, at::IntArrayRef params, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases, int64_t heads, int64_t kv_heads, double scale) {
  TORCH_CHECK((norms.size() == 2 || norms.size() == 4) && kernels.size() == 4 && params.size() == 4 &&
              weights.size() == 12 && biases.size() == 4,
              "decode_layer: 2 or 4 norms; 4 linear layers, each a kernel, a param, 3 weights and a bias or None");
  const auto linear = [&](const at::Tensor& in, int64_t i) {
    const auto y = quantized_linear(in, kernels[i], weights.data() + 3 * i, params[i]);
    const std::optional<at::Tensor> bias = biases.get(i);
    return bias ? y + *bias : y;
  };
  const int64_t tokens = x.size(0), d = k_cache.size(3);
  auto [h, res] = residual ? fused_add_rms_norm(x, *residual, norms[0], eps)
                           : std::make_tuple(rms_norm(x, norms[0], eps), x);
  const auto qkv = linear(h, 0);
  const auto part = [&](int64_t first, int64_t count) {
    return qkv.narrow(1, first * d, count * d).view({tokens, count, d});
  };
  auto q = part(0, heads), k = part(heads, kv_heads);
  if (norms.size() == 4) {
    q = rms_norm(q.reshape({-1, d}), norms[2], eps).view({tokens, heads, d});
    k = rms_norm(k.reshape({-1, d}), norms[3], eps).view({tokens, kv_heads, d});
  }
  std::tie(q, k) = rotary(q, k, cos, sin);
  store_kvcache(k, part(heads + kv_heads, kv_heads), k_cache, v_cache, slots, k_scale, v_scale);
  auto attention = at::empty_like(q);
  paged_decode_attention(attention, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, k_scale,
                         v_scale);
  std::tie(h, res) = fused_add_rms_norm(linear(attention.view({tokens, heads * d}), 1), res, norms[1], eps);
  return {linear(silu_and_mul(linear(h, 2)), 3), res};
}

}  // namespace

TORCH_LIBRARY(nanoserve_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, float k_scale=1.0, float v_scale=1.0) -> ()",
        &paged_decode_attention);
  m.def("store_kvcache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "float k_scale=1.0, float v_scale=1.0) -> ()", &store_kvcache);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &fused_add_rms_norm);
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)", &rotary);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
  m.def("w8a8_linear(Tensor x, Tensor qweight, Tensor scales, int digits) -> Tensor", &w8a8_linear);
  m.def("decode_layer(Tensor x, Tensor? residual, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "float k_scale, float v_scale, Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor[] norms, float eps, int[] kernels, int[] params, Tensor[] weights, Tensor?[] biases, "
        "int heads, int kv_heads, float scale) -> (Tensor, Tensor)", &decode_layer);
#ifdef NANOSERVE_BLOCK_LINEAR
  m.def("int4_block_linear(Tensor x, Tensor packed, Tensor scale, Tensor offset, int out_features) -> Tensor",
        &int4_block_linear);
  m.def("int8_block_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor", &int8_block_linear);
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor", &int8_linear);
#endif
#ifdef NANOSERVE_INT4_LINEAR
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scale, Tensor offset) -> Tensor", &int4_linear);
#endif
}
