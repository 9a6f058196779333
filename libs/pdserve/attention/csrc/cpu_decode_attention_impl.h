// The decode attention kernel (cpu_decode_attention.cpp says what it computes), compiled three
// times over the SIMD layer of cpu_simd.h: for AVX2 and FMA (cpu_kernels_avx2.cpp), for AVX-512
// F, BW, VL and DQ (cpu_kernels_avx512.cpp), both with bfloat16 widened to float32 and
// multiplied with FMA; and with AVX-512-BF16 enabled (cpu_decode_attention_bf16.cpp, PD_DPBF16:
// bfloat16 scores as dot products of pairs, vdpbf16ps). The including file has included
// <immintrin.h>, <ATen/Parallel.h>, <torch/extension.h>, <algorithm>, <cmath> and <vector>,
// enabled its instruction set and names the namespace (PD_KERNEL_NS); the caller has checked
// the shapes (at most kMaxGroups query heads per KV head: cpu_kernels.h). exp16 takes scores
// minus their max (all <= 0).
#include "cpu_simd.h"

namespace PD_KERNEL_NS {
namespace {

// Scores of the 4 keys at rows kr[0..3] for query heads 0..groups-1, into s[g * stride + 0..3]:
// FMA in float32 on keys widened to float32 (exact for bfloat16) and a float32 query.
template <int D, typename K>
inline void qk4(const K* const* kr, const float* q, int groups, float scale, float* s,
                int64_t stride) {
  constexpr int C = D / 16;
  for (int g = 0; g < groups; ++g) {
    vf acc[4];
    for (int j = 0; j < 4; ++j) {
      acc[j] = vmul(load16(kr[j]), load16(q + g * D));
      for (int c = 1; c < C; ++c)
        acc[j] = vfmadd(load16(kr[j] + 16 * c), load16(q + g * D + 16 * c), acc[j]);
    }
    _mm_storeu_ps(s + g * stride,
                  _mm_mul_ps(reduce4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale)));
  }
}

#ifdef PD_DPBF16
// The same for bfloat16 keys and query with AVX-512-BF16: dot products of pairs (vdpbf16ps).
template <int D>
inline void qk4(const c10::BFloat16* const* kr, const c10::BFloat16* q, int groups, float scale,
                float* s, int64_t stride) {
  constexpr int C = D / 32;  // 32 bfloat16 values per vector
  for (int g = 0; g < groups; ++g) {
    __m512 acc[4];
    for (int j = 0; j < 4; ++j) {
      acc[j] = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c)
        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(kr[j] + 32 * c),
                                  (__m512bh)_mm512_loadu_si512(q + g * D + 32 * c));
    }
    _mm_storeu_ps(s + g * stride,
                  _mm_mul_ps(reduce4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale)));
  }
}
#endif

// The query as qk4 takes it: itself where it is float32 (or bfloat16 with vdpbf16ps), else
// widened to float32 once per (sequence, KV head) into ``wide``.
inline const float* query(const float* q, int, float*) { return q; }
#ifdef PD_DPBF16
inline const c10::BFloat16* query(const c10::BFloat16* q, int, float*) { return q; }
#else
inline const float* query(const c10::BFloat16* q, int n, float* wide) {
  for (int i = 0; i < n; i += 16) store16(wide + i, load16(q + i));
  return wide;
}
#endif

using ::store16;  // float32 (cpu_simd.h)
// Round to nearest even, as torch converts float32 to bfloat16 (NaN kept quiet).
inline void store16(c10::BFloat16* p, vf x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow<false>(x));
}

// Rows [from, to) whole (every head's part: the next head reads them from cache), ahead of
// use. The K/V of a decode batch was last touched a step ago and is cold by now.
constexpr int64_t kAhead = 16;
template <typename T>
inline void prefetch_rows(const T* base, int64_t from, int64_t to, int64_t row_stride,
                          int64_t row_bytes) {
  for (int64_t l = from; l < to; ++l) {
    const char* row = reinterpret_cast<const char*>(base + l * row_stride);
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

template <typename T, int D>
void one_head(const T* q, const T* k, const T* v, int64_t row_stride, int64_t row_bytes,
              int64_t len, int groups, float scale, T* out, std::vector<float>& scores) {
  constexpr int C = D / 16;
  const int64_t padded = (len + 3) / 4 * 4;
  scores.resize(static_cast<size_t>(groups) * padded);
  float* s = scores.data();
  alignas(64) float wide[kMaxGroups * 256];
  const auto* qq = query(q, groups * D, wide);
  for (int64_t l = 0; l < len; l += 4) {
    const T* kr[4];
    for (int j = 0; j < 4; ++j) kr[j] = k + std::min(l + j, len - 1) * row_stride;
    prefetch_rows(k, l + kAhead, std::min(l + kAhead + 4, len), row_stride, row_bytes);
    qk4<D>(kr, qq, groups, scale, s + l, padded);
  }
  float inv[kMaxGroups];
  for (int g = 0; g < groups; ++g) {
    float* sg = s + g * padded;
    vf mx = vset1(-INFINITY);
    int64_t l = 0;
    for (; l + 16 <= len; l += 16) mx = vmax(mx, load16(sg + l));
    float m = vreduce_max(mx);
    for (; l < len; ++l) m = std::max(m, sg[l]);
    const vf mz = vset1(m);
    vf sum = vzero();
    for (l = 0; l < len; l += 16) {
      const int64_t n = std::min<int64_t>(16, len - l);
      vf e = keep_n(exp16(vsub(load_n(sg + l, n), mz)), n);
      store_n(sg + l, e, n);
      sum = vadd(sum, e);
    }
    inv[g] = 1.0f / vreduce_add(sum);
  }
  vf acc[kMaxGroups][C];
  for (int g = 0; g < groups; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = vzero();
  for (int64_t l = 0; l < len; ++l) {
    const T* vr = v + l * row_stride;
    if (l % 4 == 0) prefetch_rows(v, l + kAhead, std::min(l + kAhead + 4, len), row_stride, row_bytes);
    vf vz[C];
    for (int c = 0; c < C; ++c) vz[c] = load16(vr + 16 * c);
    for (int g = 0; g < groups; ++g) {
      const vf p = vset1(s[g * padded + l]);
      for (int c = 0; c < C; ++c) acc[g][c] = vfmadd(p, vz[c], acc[g][c]);
    }
  }
  for (int g = 0; g < groups; ++g)
    for (int c = 0; c < C; ++c)
      store16(out + g * D + 16 * c, vmul(acc[g][c], vset1(inv[g])));
}

template <typename T, int D>
void run(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& lens,
         double scale, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2);
  const T* qp = q.data_ptr<T>();
  const T* kp = kv.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t s0 = kv.stride(0), s1 = kv.stride(1), s2 = kv.stride(2);
  const int64_t* lp = lens.data_ptr<int64_t>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H;
      const T* k = kp + b * s1 + h * D;
      one_head<T, D>(qp + i * G * D, k, k + s0, s2, h == 0 ? H * D * sizeof(T) : 0, lp[b],
                     static_cast<int>(G),
                     static_cast<float>(scale), op + i * G * D, scores);
    }
  });
}

}  // namespace

// out = attention of q over kv (both float32 or both bfloat16), checked by the caller.
void decode(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& lens,
            double scale, torch::Tensor& out) {
  const bool bf16 = q.scalar_type() == torch::kBFloat16;
#define PD_HEAD_DIM(DIM)                                                       \
  case DIM:                                                                    \
    if (bf16) run<c10::BFloat16, DIM>(q, kv, lens, scale, out);                \
    else run<float, DIM>(q, kv, lens, scale, out);                             \
    return;
  switch (q.size(3)) {
    PD_HEAD_DIM(32)
    PD_HEAD_DIM(64)
    PD_HEAD_DIM(96)
    PD_HEAD_DIM(128)
    PD_HEAD_DIM(256)
    default:
      TORCH_CHECK(false, "head_dim must be 32, 64, 96, 128 or 256, got ", q.size(3));
  }
#undef PD_HEAD_DIM
}

}  // namespace PD_KERNEL_NS
