// The native CPU kernels for AVX-512 F, BW, VL and DQ, enabled for this file only (the module
// is compiled for AVX2): bfloat16 attention scores widened to float32 and multiplied with FMA
// (Skylake, Cascade Lake and Ice Lake Xeons; cpu_decode_attention_bf16.cpp where the CPU has
// AVX-512-BF16), and the bfloat16 elementwise kernels.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_kernels.h"

// GCC's target pragma; clang ignores it and takes the same target as an attribute.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
#endif
#define PD_KERNEL_NS avx512
#include "cpu_decode_attention_impl.h"
#include "cpu_elementwise_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
