// The loops of the bfloat16 RMSNorm and SiLU-and-mul (cpu_elementwise.cpp says what they
// compute and how they round), compiled for AVX2 and FMA (cpu_kernels_avx2.cpp) and for AVX-512
// F, BW, VL and DQ (cpu_kernels_avx512.cpp) over the SIMD layer of cpu_simd.h. The including
// file has included <ATen/Parallel.h>, <immintrin.h>, <torch/extension.h> and <cmath>, enabled
// its instruction set and names the namespace (PD_KERNEL_NS); the caller has checked the
// shapes.
#include "cpu_simd.h"

namespace PD_KERNEL_NS {
namespace {

using bf16 = c10::BFloat16;

// float32 -> bfloat16 -> float32, rounded to nearest even as torch rounds (NaN: torch's).
inline vf round_bf16(vf x) { return widen(narrow<true>(x)); }
inline void store_bf16(bf16* p, vf x) {  // torch's NaN (the attention keeps payloads)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow<true>(x));
}

}  // namespace

// out = weight * bf16(sum * rsqrt(mean(sum^2) + eps)), sum = bf16(x (+ residual)).
void norm_rows(const bf16* x, const bf16* r, const bf16* w, bf16* out, bf16* sum_out,
               int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bf16* xi = x + i * n;
      bf16* oi = out + i * n;
      vf sq = vzero();
      for (int64_t j = 0; j < n; j += 16) {
        vf v = load16(xi + j);
        if (r != nullptr) {
          v = round_bf16(vadd(v, load16(r + i * n + j)));
          store_bf16(sum_out + i * n + j, v);
        }
        sq = vfmadd(v, v, sq);
      }
      const float inv = 1.0f / std::sqrt(vreduce_add(sq) / n + eps);
      const bf16* src = r != nullptr ? sum_out + i * n : xi;
      for (int64_t j = 0; j < n; j += 16) {
        vf normed = round_bf16(vmul(load16(src + j), vset1(inv)));
        store_bf16(oi + j, vmul(load16(w + j), normed));
      }
    }
  });
}

// x [rows, 2n] = [gate | up] -> out [rows, n] = bf16(bf16(silu(gate)) * up)
void silu_and_mul_rows(const bf16* xp, bf16* op, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bf16* gate = xp + i * 2 * n;
      for (int64_t j = 0; j < n; j += 16) {
        vf g = load16(gate + j);
        vf silu = vdiv(g, vadd(vset1(1.0f), exp16(vsub(vzero(), g))));
        store_bf16(op + i * n + j, vmul(round_bf16(silu), load16(gate + n + j)));
      }
    }
  });
}

}  // namespace PD_KERNEL_NS
