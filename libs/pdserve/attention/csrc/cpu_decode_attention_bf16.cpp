// The decode attention kernel (cpu_decode_attention_impl.h) with AVX-512 and AVX-512-BF16
// enabled for this file only: bfloat16 scores as dot products of pairs (vdpbf16ps).
// cpu_decode_attention.cpp calls it only where the CPU has the instructions.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_kernels.h"

// GCC's target pragma; clang ignores it and takes the same target as an attribute.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#endif
#define PD_DPBF16 1
#define PD_KERNEL_NS avx512bf16
#include "cpu_decode_attention_impl.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
