// bfloat16 RMSNorm (with the residual add) and SiLU-and-mul on the CPU, one pass each, rounding
// where Hugging Face's bfloat16 modules round: the residual sum to bfloat16, the normalised
// value to bfloat16 before the weight, SiLU's output to bfloat16 before the product. Only the
// float32 sum of squares (summed in another order) and exp (a polynomial) differ from torch's,
// in float32's last bits. Used by pdserve/models/kernels.py (CpuKernels), with the bfloat16
// RoPE of q and k (rope_qk_bf16, each product, sum and difference rounded as torch's ops
// round). Also the sampler's float32 argmax (argmax_f32), exact. Built with
// cpu_decode_attention.cpp into one module (pdserve/attention/cpu_decode.py).
#include <torch/extension.h>

#include <tuple>

#include "cpu_kernels.h"  // avx2::, avx512:: norm_rows and silu_and_mul_rows; isa()

namespace {

using bf16 = c10::BFloat16;

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 &&
                  x.is_contiguous() && x.size(1) % 16 == 0,
              name, " must be a contiguous bfloat16 CPU [T, N] tensor, N a multiple of 16");
}

void norm_rows(const bf16* x, const bf16* r, const bf16* w, bf16* out, bf16* sum_out,
               int64_t rows, int64_t n, float eps) {
  if (isa() == Isa::avx2) avx2::norm_rows(x, r, w, out, sum_out, rows, n, eps);
  else avx512::norm_rows(x, r, w, out, sum_out, rows, n, eps);
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
  if (isa() == Isa::avx2) avx2::silu_and_mul_rows(xp, op, rows, n);
  else avx512::silu_and_mul_rows(xp, op, rows, n);
  return out;
}

// x [T, N] float32 -> [T] int64, torch.argmax(x, -1): the sampler's greedy pick. torch's CPU
// argmax takes 2-4 ms for 32 rows of a 49k vocabulary (one thread), ~9% of a SmolLM2 decode step.
torch::Tensor argmax_f32(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2 &&
                  x.is_contiguous() && x.size(1) >= 1,
              "x must be a contiguous float32 CPU [T, N] tensor, N >= 1");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  if (isa() == Isa::avx2) avx2::argmax_rows(xp, op, x.size(0), x.size(1));
  else avx512::argmax_rows(xp, op, x.size(0), x.size(1));
  return out;
}

// qk [T, H, D] bfloat16 (the fused projection's q and k heads: any token stride, heads D
// apart), cos and sin [T, D / 2] -> (q [T, hq, D], k [T, H - hq, D]) rotated, contiguous.
std::tuple<torch::Tensor, torch::Tensor> rope_qk_bf16(const torch::Tensor& qk,
                                                      const torch::Tensor& cos,
                                                      const torch::Tensor& sin, int64_t hq) {
  TORCH_CHECK(qk.device().is_cpu() && qk.scalar_type() == torch::kBFloat16 && qk.dim() == 3 &&
                  qk.stride(2) == 1 && qk.stride(1) == qk.size(2) && qk.size(2) % 32 == 0,
              "qk must be a bfloat16 CPU [T, H, D] tensor with contiguous heads, D a multiple "
              "of 32");
  const int64_t T = qk.size(0), H = qk.size(1), D = qk.size(2);
  TORCH_CHECK(hq >= 0 && hq <= H, "num_q_heads must be in [0, H]");
  for (const auto* c : {&cos, &sin})
    TORCH_CHECK(c->scalar_type() == torch::kBFloat16 && c->is_contiguous() && c->dim() == 2 &&
                    c->size(0) == T && c->size(1) == D / 2,
                "cos and sin must be contiguous bfloat16 [T, D / 2]");
  auto q = torch::empty({T, hq, D}, qk.options());
  auto k = torch::empty({T, H - hq, D}, qk.options());
  if (T == 0) return {q, k};
  const bf16 *x = qk.data_ptr<bf16>(), *c = cos.data_ptr<bf16>(), *s = sin.data_ptr<bf16>();
  bf16 *qp = q.data_ptr<bf16>(), *kp = k.data_ptr<bf16>();
  if (isa() == Isa::avx2) avx2::rope_rows(x, qk.stride(0), c, s, qp, kp, T, H, hq, D);
  else avx512::rope_rows(x, qk.stride(0), c, s, qp, kp, T, H, hq, D);
  return {q, k};
}
