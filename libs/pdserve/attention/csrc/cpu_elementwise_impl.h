// The loops of the bfloat16 RMSNorm, SiLU-and-mul and RoPE and of the float32 argmax
// (cpu_elementwise.cpp says what they compute and how they round), compiled for AVX2 and FMA
// (cpu_kernels_avx2.cpp) and for AVX-512 F, BW, VL and DQ (cpu_kernels_avx512.cpp) over the
// SIMD layer of cpu_simd.h. The including file has included <ATen/Parallel.h>, <immintrin.h>,
// <torch/extension.h> and <cmath>, enabled its instruction set and names the namespace
// (PD_KERNEL_NS); the caller has checked the shapes.
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

// Neox RoPE of the fused projection's q and k heads, rounding as torch's bfloat16 ops round
// (Hugging Face's apply_rotary_pos_emb): with h = D / 2, x1 = x[:h], x2 = x[h:],
//   out[:h] = bf16(bf16(x1 * cos) - bf16(x2 * sin)),
//   out[h:] = bf16(bf16(x2 * cos) + bf16(x1 * sin)).
// qk: T tokens of H heads of D values (token stride ``stride``, head stride D); the first
// ``hq`` heads go to q [T, hq, D], the rest to k [T, H - hq, D]; cos, sin [T, h].
void rope_rows(const bf16* qk, int64_t stride, const bf16* cos, const bf16* sin, bf16* q,
               bf16* k, int64_t tokens, int64_t heads, int64_t hq, int64_t d) {
  const int64_t h = d / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < h; j += 16) {
        const vf c = load16(cos + t * h + j), s = load16(sin + t * h + j);
        for (int64_t a = 0; a < heads; ++a) {
          const bf16* x = qk + t * stride + a * d;
          bf16* o = a < hq ? q + (t * hq + a) * d : k + (t * (heads - hq) + a - hq) * d;
          const vf x1 = load16(x + j), x2 = load16(x + h + j);
          store_bf16(o + j, vsub(round_bf16(vmul(x1, c)), round_bf16(vmul(x2, s))));
          store_bf16(o + h + j, vadd(round_bf16(vmul(x2, c)), round_bf16(vmul(x1, s))));
        }
      }
    }
  });
}

// out[i] = torch.argmax(x[i]) for float32 rows: the first index of the row's largest value,
// or of its first NaN where it has one (torch counts NaN as the largest). Two passes over a
// row (its maximum, then where it first occurs) that stay in cache: one row of a 150k-token
// vocabulary is 600 KiB.
void argmax_rows(const float* x, int64_t* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xi = x + i * n;
      const int64_t body = n / 16 * 16;
      vf mx = vset1(-INFINITY);
      unsigned nan = 0;
      for (int64_t j = 0; j < body; j += 16) {
        const vf v = load16(xi + j);
        nan |= nan_lanes(v);
        mx = vmax(mx, v);
      }
      float m = vreduce_max(mx);
      for (int64_t j = body; j < n; ++j) {
        nan |= std::isnan(xi[j]) ? 1u : 0u;
        if (xi[j] > m) m = xi[j];
      }
      int64_t at = 0;
      if (nan != 0) {
        while (!std::isnan(xi[at])) ++at;
      } else {
        const vf mz = vset1(m);
        at = body;  // where none of the body holds it, the tail does
        for (int64_t j = 0; j < body; j += 16) {
          const unsigned hit = eq_lanes(load16(xi + j), mz);
          if (hit != 0) {
            at = j + __builtin_ctz(hit);
            break;
          }
        }
        if (at == body)
          while (xi[at] != m) ++at;
      }
      out[i] = at;
    }
  });
}

}  // namespace PD_KERNEL_NS
