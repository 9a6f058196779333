// The SIMD layer of the native CPU kernels (cpu_decode_attention_impl.h,
// cpu_elementwise_impl.h): a vector of 16 float32 values (vf) and the operations the kernels
// use, for one instruction set per translation unit:
//   - AVX-512 F, BW, VL and DQ (the default): vf is one __m512, and each function is the one
//     intrinsic the kernels called directly before this layer existed (their disassembly is
//     the same: docs/benchmarks.md, "AVX2");
//   - AVX2 and FMA (PD_AVX2 defined): vf is two __m256, masks are vectors.
// The including file has included <immintrin.h> and <torch/extension.h>, and enabled the
// instruction set (a GCC target pragma, or the module's -mavx2 -mfma for AVX2).
#pragma once

namespace {

#ifndef PD_AVX2

using vf = __m512;

inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline float vreduce_add(vf x) { return _mm512_reduce_add_ps(x); }
inline float vreduce_max(vf x) { return _mm512_reduce_max_ps(x); }
inline vf load16(const float* p) { return _mm512_loadu_ps(p); }
inline void store16(float* p, vf x) { _mm512_storeu_ps(p, x); }

// The first n (1..16) lanes; the others read as zero, are zeroed, or are not written.
inline __mmask16 first(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
inline vf load_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline vf keep_n(vf x, int64_t n) { return _mm512_maskz_mov_ps(first(n), x); }
inline void store_n(float* p, vf x, int64_t n) { _mm512_mask_storeu_ps(p, first(n), x); }

// Bit i set where lane i of a equals lane i of b (a NaN equals nothing); where lane i is NaN.
inline unsigned eq_lanes(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline unsigned nan_lanes(vf x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }

// 16 bfloat16 values (a __m256i) widened to float32: exact, bfloat16 is float32's top half.
inline vf widen(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// float32 -> bfloat16, round to nearest even (as torch). A NaN becomes the canonical quiet
// NaN (kCanonicalNaN, as torch writes it) or keeps its payload with the quiet bit set.
template <bool kCanonicalNaN>
inline __m256i narrow(vf x) {
  __m512i bits = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  __m512i quiet = kCanonicalNaN ? _mm512_set1_epi32(0x7fc00000)
                                : _mm512_or_si512(bits, _mm512_set1_epi32(0x400000));
  rounded = _mm512_mask_mov_epi32(rounded, nan, quiet);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// [sum a, sum b, sum c, sum d]
inline __m128 reduce4(vf a, vf b, vf c, vf d) {
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

inline vf round_nearest(vf x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline vf times_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n

#else  // AVX2 and FMA

struct vf {
  __m256 lo, hi;
};

inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf vmin(vf a, vf b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline vf vfmadd(vf a, vf b, vf c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vreduce_add(vf x) { return hsum8(_mm256_add_ps(x.lo, x.hi)); }
inline float vreduce_max(vf x) {
  __m256 m = _mm256_max_ps(x.lo, x.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vf load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store16(float* p, vf x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}

// The first n (1..16) lanes as all-ones 32-bit masks: lane i < n.
struct mask16 {
  __m256i lo, hi;
};
inline mask16 first(int64_t n) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i nn = _mm256_set1_epi32(static_cast<int>(n));
  return {_mm256_cmpgt_epi32(nn, iota),
          _mm256_cmpgt_epi32(nn, _mm256_add_epi32(iota, _mm256_set1_epi32(8)))};
}
inline vf load_n(const float* p, int64_t n) {
  const mask16 m = first(n);
  return {_mm256_maskload_ps(p, m.lo), _mm256_maskload_ps(p + 8, m.hi)};
}
inline vf keep_n(vf x, int64_t n) {
  const mask16 m = first(n);
  return {_mm256_and_ps(x.lo, _mm256_castsi256_ps(m.lo)),
          _mm256_and_ps(x.hi, _mm256_castsi256_ps(m.hi))};
}
inline void store_n(float* p, vf x, int64_t n) {
  const mask16 m = first(n);
  _mm256_maskstore_ps(p, m.lo, x.lo);
  _mm256_maskstore_ps(p + 8, m.hi, x.hi);
}

inline unsigned lanes16(__m256 lo, __m256 hi) {
  return static_cast<unsigned>(_mm256_movemask_ps(lo)) |
         static_cast<unsigned>(_mm256_movemask_ps(hi)) << 8;
}
inline unsigned eq_lanes(vf a, vf b) {
  return lanes16(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ));
}
inline unsigned nan_lanes(vf x) {
  return lanes16(_mm256_cmp_ps(x.lo, x.lo, _CMP_UNORD_Q), _mm256_cmp_ps(x.hi, x.hi, _CMP_UNORD_Q));
}

inline vf widen(__m256i raw) {
  return {_mm256_castsi256_ps(
              _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16)),
          _mm256_castsi256_ps(
              _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16))};
}

template <bool kCanonicalNaN>
inline __m256i narrow8(__m256 x) {  // 8 bfloat16 values in the low 16 bits of each lane
  __m256i bits = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  __m256i quiet = kCanonicalNaN ? _mm256_set1_epi32(0x7fc00000)
                                : _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  rounded = _mm256_blendv_epi8(rounded, quiet, nan);
  return _mm256_srli_epi32(rounded, 16);
}
template <bool kCanonicalNaN>
inline __m256i narrow(vf x) {  // packus interleaves 128-bit lanes; the permute restores order
  return _mm256_permute4x64_epi64(
      _mm256_packus_epi32(narrow8<kCanonicalNaN>(x.lo), narrow8<kCanonicalNaN>(x.hi)), 0xD8);
}

inline __m128 reduce4(vf a, vf b, vf c, vf d) {
  __m256 ab = _mm256_hadd_ps(_mm256_add_ps(a.lo, a.hi), _mm256_add_ps(b.lo, b.hi));
  __m256 cd = _mm256_hadd_ps(_mm256_add_ps(c.lo, c.hi), _mm256_add_ps(d.lo, d.hi));
  __m256 s = _mm256_hadd_ps(ab, cd);  // [a b c d] of each 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

inline vf round_nearest(vf x) {
  return {_mm256_round_ps(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// p * 2^n for integral n in [-126, 127] (exp16's range): n is built as a float32's exponent.
inline __m256 pow2(__m256 n) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vf times_pow2(vf p, vf n) {
  return {_mm256_mul_ps(p.lo, pow2(n.lo)), _mm256_mul_ps(p.hi, pow2(n.hi))};
}

#endif

inline vf load16(const c10::BFloat16* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp(x) for |x| <= 87 (clamped beyond): 2^(x log2 e), a degree-6 polynomial on the fraction,
// the power of two for the rest.
inline vf exp16(vf x) {
  x = vmin(vmax(x, vset1(-87.0f)), vset1(87.0f));
  vf t = vmul(x, vset1(1.44269504088896341f));
  vf n = round_nearest(t);
  vf f = vsub(t, n);
  vf p = vset1(1.535336188319500e-4f);
  p = vfmadd(p, f, vset1(1.339887440266574e-3f));
  p = vfmadd(p, f, vset1(9.618437357674640e-3f));
  p = vfmadd(p, f, vset1(5.550332471162809e-2f));
  p = vfmadd(p, f, vset1(2.402264791363012e-1f));
  p = vfmadd(p, f, vset1(6.931472028550421e-1f));
  p = vfmadd(p, f, vset1(1.0f));
  return times_pow2(p, n);
}

}  // namespace
