// The decode attention kernel (cpu_decode_attention.cpp says what it computes), compiled twice:
// in cpu_decode_attention.cpp for AVX-512 F, BW, VL and DQ (bfloat16 widened to float32 and
// multiplied with FMA), and in cpu_decode_attention_bf16.cpp with AVX-512-BF16 enabled
// (PD_DPBF16: bfloat16 scores as dot products of pairs, vdpbf16ps). The including file has
// included <immintrin.h>, <ATen/Parallel.h>, <torch/extension.h>, <algorithm>, <cmath> and
// <vector>, and names the namespace (PD_KERNEL_NS); the caller has checked the shapes.
// load16 and exp16 (exp of scores minus their max, all <= 0) come from cpu_simd.h.
#include "cpu_simd.h"

namespace PD_KERNEL_NS {
namespace {

constexpr int kMaxGroups = 8;

// [sum a, sum b, sum c, sum d]
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of the 4 keys at rows kr[0..3] for query heads 0..groups-1, into s[g * stride + 0..3]:
// FMA in float32 on keys widened to float32 (exact for bfloat16) and a float32 query.
template <int D, typename K>
inline void qk4(const K* const* kr, const float* q, int groups, float scale, float* s,
                int64_t stride) {
  constexpr int C = D / 16;
  for (int g = 0; g < groups; ++g) {
    __m512 acc[4];
    for (int j = 0; j < 4; ++j) {
      acc[j] = _mm512_mul_ps(load16(kr[j]), _mm512_loadu_ps(q + g * D));
      for (int c = 1; c < C; ++c)
        acc[j] = _mm512_fmadd_ps(load16(kr[j] + 16 * c), _mm512_loadu_ps(q + g * D + 16 * c),
                                 acc[j]);
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
  for (int i = 0; i < n; i += 16) _mm512_storeu_ps(wide + i, load16(q + i));
  return wide;
}
#endif

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  // Round to nearest even, as torch converts float32 to bfloat16 (NaN kept quiet).
  __m512i bits = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
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
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t l = 0;
    for (; l + 16 <= len; l += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + l));
    float m = _mm512_reduce_max_ps(mx);
    for (; l < len; ++l) m = std::max(m, sg[l]);
    const __m512 mz = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (l = 0; l < len; l += 16) {
      const int64_t n = std::min<int64_t>(16, len - l);
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      __m512 e = _mm512_maskz_mov_ps(
          mask, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sg + l), mz)));
      _mm512_mask_storeu_ps(sg + l, mask, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  __m512 acc[kMaxGroups][C];
  for (int g = 0; g < groups; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t l = 0; l < len; ++l) {
    const T* vr = v + l * row_stride;
    if (l % 4 == 0) prefetch_rows(v, l + kAhead, std::min(l + kAhead + 4, len), row_stride, row_bytes);
    __m512 vz[C];
    for (int c = 0; c < C; ++c) vz[c] = load16(vr + 16 * c);
    for (int g = 0; g < groups; ++g) {
      const __m512 p = _mm512_set1_ps(s[g * padded + l]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vz[c], acc[g][c]);
    }
  }
  for (int g = 0; g < groups; ++g)
    for (int c = 0; c < C; ++c)
      store16(out + g * D + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
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
