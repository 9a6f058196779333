// Decode attention on the CPU: one new query token per sequence against that sequence's K/V,
// the query heads that share a KV head done together. Built at first use by
// pdserve/attention/cpu_decode.py (torch.utils.cpp_extension), for CPUs with AVX2 and FMA;
// the kernels run with AVX-512 F, BW, VL and DQ, and AVX-512-BF16, where the CPU has them
// (cpu_kernels.h names the files); that module says why torch's SDPA is slower here and what
// was measured. This file checks the inputs and chooses the instruction set.
//
//   q    [B, H, G, D]   contiguous; H KV heads, G query heads per KV head
//   kv   [2, B, L, H*D] K then V, rows of one token's heads (each row contiguous; any
//                       batch and token strides: the paged gather or the decode mirror)
//   lens [B] int64      keys of each sequence (<= L); keys past it are never read
//   out  [B, H, G, D]   softmax(scale * q k^T) v, in q's dtype
//
// Per (sequence, KV head): scores of 4 keys at a time for all G query heads (bfloat16: dot
// products of pairs with vdpbf16ps where the CPU has them, else widened to float32; float32
// and widened bfloat16: FMA), each 4 reduced in one shuffle tree; the softmax in float32 with
// a polynomial exp; then the weighted sum of V rows in float32. 16 lanes throughout: one
// AVX-512 register, or two AVX2 ones (cpu_simd.h).
// Every score goes through the same 4-key path (a short tail is padded), so a key's score
// does not depend on where it falls.
#include <torch/extension.h>

#include <string>

#include "cpu_kernels.h"

namespace {

bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
bool has_avx512bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }

// The widest set this CPU has, unless set_isa chose a narrower one (the tests run each).
Isa current = has_avx512bf16() ? Isa::avx512bf16 : has_avx512() ? Isa::avx512 : Isa::avx2;

}  // namespace

Isa isa() { return current; }

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
  if (current == Isa::avx512bf16 && q.scalar_type() == torch::kBFloat16)
    avx512bf16::decode(q, kv, lens, scale, out);
  else if (current == Isa::avx2) avx2::decode(q, kv, lens, scale, out);
  else avx512::decode(q, kv, lens, scale, out);
  return out;
}

// The instruction set the kernels run with: "avx512bf16" (bfloat16 scores with vdpbf16ps; the
// rest as "avx512"), "avx512" (AVX-512 F, BW, VL, DQ; bfloat16 widened to float32, FMA) or
// "avx2" (AVX2 and FMA, the same arithmetic on 8 lanes).
std::string isa_name() {
  return current == Isa::avx512bf16 ? "avx512bf16" : current == Isa::avx512 ? "avx512" : "avx2";
}

void set_isa(const std::string& name) {
  if (name == "avx2") current = Isa::avx2;
  else if (name == "avx512" || name == "avx512bf16") {
    TORCH_CHECK(has_avx512(), "this CPU has no AVX-512 (F, BW, VL and DQ)");
    TORCH_CHECK(name == "avx512" || has_avx512bf16(), "this CPU has no AVX-512-BF16 (vdpbf16ps)");
    current = name == "avx512" ? Isa::avx512 : Isa::avx512bf16;
  } else TORCH_CHECK(false, "isa must be avx2, avx512 or avx512bf16, got ", name);
}

// cpu_elementwise.cpp
torch::Tensor rms_norm_bf16(const torch::Tensor& x, const torch::Tensor& weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_bf16(const torch::Tensor& x,
                                                           const torch::Tensor& residual,
                                                           const torch::Tensor& weight,
                                                           double eps);
torch::Tensor silu_and_mul_bf16(const torch::Tensor& x);
torch::Tensor argmax_f32(const torch::Tensor& x);
std::tuple<torch::Tensor, torch::Tensor> rope_qk_bf16(const torch::Tensor& qk,
                                                      const torch::Tensor& cos,
                                                      const torch::Tensor& sin, int64_t hq);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "decode attention over per-sequence K/V rows");
  m.def("isa", &isa_name, "the instruction set the kernels run with");
  m.def("set_isa", &set_isa, "run with this instruction set (avx2, avx512, avx512bf16)");
  m.def("rms_norm_bf16", &rms_norm_bf16, "bfloat16 RMSNorm, Hugging Face's rounding");
  m.def("add_rms_norm_bf16", &add_rms_norm_bf16, "(rms_norm(x + residual), x + residual)");
  m.def("silu_and_mul_bf16", &silu_and_mul_bf16, "silu(gate) * up of [gate | up]");
  m.def("argmax_f32", &argmax_f32, "torch.argmax(x, -1) of float32 rows");
  m.def("rope_qk_bf16", &rope_qk_bf16, "(q, k) of [q | k] heads rotated (neox), torch's rounding");
}
