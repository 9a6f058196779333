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

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#define PD_DPBF16 1
#define PD_KERNEL_NS avx512bf16
#include "cpu_decode_attention_impl.h"
#pragma GCC pop_options
