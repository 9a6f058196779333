// Decode attention on the CPU: one new query token per sequence against that sequence's K/V,
// the query heads that share a KV head done together. Built at first use by
// pdserve/attention/cpu_decode.py (torch.utils.cpp_extension), for CPUs with AVX-512 F, BW,
// VL, DQ and BF16; that module says why torch's SDPA is slower here and what was measured.
//
//   q    [B, H, G, D]   contiguous; H KV heads, G query heads per KV head
//   kv   [2, B, L, H*D] K then V, rows of one token's heads (each row contiguous; any
//                       batch and token strides: the paged gather or the decode mirror)
//   lens [B] int64      keys of each sequence (<= L); keys past it are never read
//   out  [B, H, G, D]   softmax(scale * q k^T) v, in q's dtype
//
// Per (sequence, KV head): scores of 4 keys at a time for all G query heads (bfloat16: dot
// products of pairs with vdpbf16ps; float32: FMA), each 4 reduced in one shuffle tree; the
// softmax in float32 with a polynomial exp; then the weighted sum of V rows in float32.
// Every score goes through the same 4-key path (a short tail is padded), so a key's score
// does not depend on where it falls.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int kMaxGroups = 8;

inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// exp(x) for x <= 0: 2^(x log2 e), a degree-6 polynomial on the fraction, scalef for the rest.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// [sum a, sum b, sum c, sum d]
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of the 4 keys at rows kr[0..3] for query heads 0..groups-1, into s[g * stride + 0..3].
template <int D>
inline void qk4(const float* const* kr, const float* q, int groups, float scale, float* s,
                int64_t stride) {
  constexpr int C = D / 16;
  for (int g = 0; g < groups; ++g) {
    __m512 acc[4];
    for (int j = 0; j < 4; ++j) {
      acc[j] = _mm512_mul_ps(_mm512_loadu_ps(kr[j]), _mm512_loadu_ps(q + g * D));
      for (int c = 1; c < C; ++c)
        acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(kr[j] + 16 * c),
                                 _mm512_loadu_ps(q + g * D + 16 * c), acc[j]);
    }
    _mm_storeu_ps(s + g * stride,
                  _mm_mul_ps(reduce4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale)));
  }
}

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
  for (int64_t l = 0; l < len; l += 4) {
    const T* kr[4];
    for (int j = 0; j < 4; ++j) kr[j] = k + std::min(l + j, len - 1) * row_stride;
    prefetch_rows(k, l + kAhead, std::min(l + kAhead + 4, len), row_stride, row_bytes);
    qk4<D>(kr, q, groups, scale, s + l, padded);
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

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& kv,
                               const torch::Tensor& lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu() && lens.device().is_cpu(),
              "decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous(), "q must be a contiguous [B, H, G, D] tensor");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kFloat,
              "q must be float32 or bfloat16");
  TORCH_CHECK(kv.scalar_type() == q.scalar_type(), "kv must have q's dtype");
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  TORCH_CHECK(G >= 1 && G <= kMaxGroups, "at most 8 query heads per KV head");
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.size(1) == B && kv.size(3) == H * D &&
                  kv.stride(3) == 1,
              "kv must be [2, B, L, H * D] with contiguous rows");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.scalar_type() == torch::kLong &&
                  lens.is_contiguous(),
              "lens must be a contiguous int64 [B]");
  if (B > 0) {
    const int64_t lo = lens.min().item<int64_t>(), hi = lens.max().item<int64_t>();
    TORCH_CHECK(lo >= 1 && hi <= kv.size(2), "every length must be in [1, kv.size(2)]");
  }
  auto out = torch::empty_like(q);
  if (B == 0) return out;
  const bool bf16 = q.scalar_type() == torch::kBFloat16;
#define PD_HEAD_DIM(DIM)                                                       \
  case DIM:                                                                    \
    if (bf16) run<c10::BFloat16, DIM>(q, kv, lens, scale, out);                \
    else run<float, DIM>(q, kv, lens, scale, out);                             \
    return out;
  switch (D) {
    PD_HEAD_DIM(32)
    PD_HEAD_DIM(64)
    PD_HEAD_DIM(96)
    PD_HEAD_DIM(128)
    PD_HEAD_DIM(256)
    default:
      TORCH_CHECK(false, "head_dim must be 32, 64, 96, 128 or 256, got ", D);
  }
#undef PD_HEAD_DIM
  return out;
}

// cpu_elementwise.cpp
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_bf16(const torch::Tensor& x,
                                                           const torch::Tensor& residual,
                                                           const torch::Tensor& weight,
                                                           double eps);
torch::Tensor silu_and_mul_bf16(const torch::Tensor& x);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over per-sequence K/V rows");
  m.def("rms_norm_bf16", &rms_norm_bf16, "bfloat16 RMSNorm, Hugging Face's rounding");
  m.def("add_rms_norm_bf16", &add_rms_norm_bf16, "(rms_norm(x + residual), x + residual)");
  m.def("silu_and_mul_bf16", &silu_and_mul_bf16, "silu(gate) * up of [gate | up]");
}
