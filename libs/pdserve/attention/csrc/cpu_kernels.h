// The native CPU kernels compiled once per instruction set, and which set runs: AVX2 and FMA
// (cpu_kernels_avx2.cpp), AVX-512 F, BW, VL and DQ (cpu_kernels_avx512.cpp), AVX-512 with
// AVX-512-BF16 for bfloat16 attention scores (cpu_decode_attention_bf16.cpp). The module itself
// (cpu_decode_attention.cpp, cpu_elementwise.cpp) is compiled for AVX2 and FMA, so that it loads
// on any CPU with them, and calls the AVX-512 code only where the CPU has it (isa()).
#pragma once

#include <torch/extension.h>

enum class Isa { avx2, avx512, avx512bf16 };

constexpr int kMaxGroups = 8;  // query heads per KV head

Isa isa();  // cpu_decode_attention.cpp

#define PD_DECLARE_DECODE                                                                   \
  void decode(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& lens,   \
              double scale, torch::Tensor& out);
#define PD_DECLARE_ELEMENTWISE                                                              \
  void norm_rows(const c10::BFloat16* x, const c10::BFloat16* r, const c10::BFloat16* w,    \
                 c10::BFloat16* out, c10::BFloat16* sum_out, int64_t rows, int64_t n,       \
                 float eps);                                                                \
  void silu_and_mul_rows(const c10::BFloat16* x, c10::BFloat16* out, int64_t rows, int64_t n); \
  void argmax_rows(const float* x, int64_t* out, int64_t rows, int64_t n);                 \
  void rope_rows(const c10::BFloat16* qk, int64_t stride, const c10::BFloat16* cos,          \
                 const c10::BFloat16* sin, c10::BFloat16* q, c10::BFloat16* k, int64_t tokens, \
                 int64_t heads, int64_t hq, int64_t d);

namespace avx2 {
PD_DECLARE_DECODE
PD_DECLARE_ELEMENTWISE
}  // namespace avx2
namespace avx512 {
PD_DECLARE_DECODE
PD_DECLARE_ELEMENTWISE
}  // namespace avx512
namespace avx512bf16 {
PD_DECLARE_DECODE
}  // namespace avx512bf16

#undef PD_DECLARE_DECODE
#undef PD_DECLARE_ELEMENTWISE
