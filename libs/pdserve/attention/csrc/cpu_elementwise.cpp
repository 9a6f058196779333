// bfloat16 RMSNorm (with the residual add) and SiLU-and-mul on the CPU, one pass each, rounding
// where Hugging Face's bfloat16 modules round: the residual sum to bfloat16, the normalised
// value to bfloat16 before the weight, SiLU's output to bfloat16 before the product. Only the
// float32 sum of squares (summed in another order) and exp (a polynomial) differ from torch's,
// in float32's last bits. Used by pdserve/models/kernels.py (CpuKernels); built with
// cpu_decode_attention.cpp into one module (pdserve/attention/cpu_decode.py).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <tuple>

#include "cpu_simd.h"  // load16, exp16

namespace {

using bf16 = c10::BFloat16;

// float32 -> bfloat16, round to nearest even (as torch), NaN kept quiet.
inline __m256i to_bf16(__m512 x) {
  __m512i bits = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
inline __m512 round_bf16(__m512 x) {  // the float32 value of x rounded to bfloat16
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}
inline void store16(bf16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x));
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 &&
                  x.is_contiguous() && x.size(1) % 16 == 0,
              name, " must be a contiguous bfloat16 CPU [T, N] tensor, N a multiple of 16");
}

// out = weight * bf16(sum * rsqrt(mean(sum^2) + eps)), sum = bf16(x (+ residual)).
void norm_rows(const bf16* x, const bf16* r, const bf16* w, bf16* out, bf16* sum_out,
               int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bf16* xi = x + i * n;
      bf16* oi = out + i * n;
      __m512 sq = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) {
        __m512 v = load16(xi + j);
        if (r != nullptr) {
          v = round_bf16(_mm512_add_ps(v, load16(r + i * n + j)));
          store16(sum_out + i * n + j, v);
        }
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / n + eps);
      const bf16* src = r != nullptr ? sum_out + i * n : xi;
      for (int64_t j = 0; j < n; j += 16) {
        __m512 normed = round_bf16(_mm512_mul_ps(load16(src + j), _mm512_set1_ps(inv)));
        store16(oi + j, _mm512_mul_ps(load16(w + j), normed));
      }
    }
  });
}

}  // namespace

torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "weight must be a contiguous bfloat16 [N]");
  auto out = torch::empty_like(x);
  norm_rows(x.data_ptr<bf16>(), nullptr, weight.data_ptr<bf16>(), out.data_ptr<bf16>(), nullptr,
            x.size(0), x.size(1), static_cast<float>(eps));
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_bf16(const torch::Tensor& x,
                                                           const torch::Tensor& residual,
                                                           const torch::Tensor& weight,
                                                           double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "residual must have x's shape");
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && weight.is_contiguous() &&
                  weight.numel() == x.size(1),
              "weight must be a contiguous bfloat16 [N]");
  auto out = torch::empty_like(x);
  auto sum = torch::empty_like(x);
  norm_rows(x.data_ptr<bf16>(), residual.data_ptr<bf16>(), weight.data_ptr<bf16>(),
            out.data_ptr<bf16>(), sum.data_ptr<bf16>(), x.size(0), x.size(1),
            static_cast<float>(eps));
  return {out, sum};
}

// x [T, 2N] = [gate | up] -> bf16(bf16(silu(gate)) * up) [T, N]
torch::Tensor silu_and_mul_bf16(const torch::Tensor& x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  TORCH_CHECK(n % 16 == 0, "x's half width must be a multiple of 16");
  auto out = torch::empty({rows, n}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bf16* gate = xp + i * 2 * n;
      for (int64_t j = 0; j < n; j += 16) {
        __m512 g = load16(gate + j);
        __m512 silu = _mm512_div_ps(
            g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store16(op + i * n + j, _mm512_mul_ps(round_bf16(silu), load16(gate + n + j)));
      }
    }
  });
  return out;
}
