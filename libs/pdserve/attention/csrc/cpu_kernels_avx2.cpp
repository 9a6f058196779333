// The native CPU kernels for AVX2 and FMA (Haswell and later Intel CPUs, AMD Zen 1-3): the
// module's own flags (-mavx2 -mfma), cpu_simd.h's 16 lanes as two __m256.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_kernels.h"

#define PD_AVX2 1
#define PD_KERNEL_NS avx2
#include "cpu_decode_attention_impl.h"
#include "cpu_elementwise_impl.h"
