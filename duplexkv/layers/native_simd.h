/* Vector helpers shared by the kernels (AVX-512 builds only).
 *
 * v16_exp2: 2^x for 16 floats by a polynomial of our own (the same instructions for every lane
 * and every call, so a value's result never depends on its neighbours or on which kernel asks):
 * x = n + f, n an integer and |f| <= 0.5, 2^f by its Taylor series to degree 6 (relative error
 * ~1e-7 over the range, 2^0 = 1 exactly), then scaled by 2^n. Inputs below -126 give 2^-126 (a
 * caller masks what must be exactly zero); large inputs overflow to infinity. Every step is a
 * builtin the compiler may not reassociate under -ffast-math (FMAs, an explicitly rounded sub).
 *
 * v16_silu_mul: bf16(bf16(silu(x)) * up) for bf16 values x and up (as floats), the one formula of
 * the bf16 SiLU kernel (native_bf16.h) and of the AMX linear's fused gate/up epilogue
 * (native_amx.h), so both give the same bits: every step explicitly rounded, e^-x by v16_exp2.
 */
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 v16_exp2(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_round_ps(x, n, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#if defined(__AVX512BF16__)
#define V16_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline __m512 bf_load16(const uint16_t *p) { /* 16 bf16 -> float32 */
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 bf_round16(__m512 x) { /* to bf16 (nearest-even) and back */
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

static inline __m256i v16_silu_mul(__m512 x, __m512 up) { /* -> 16 bf16 */
    const __m512 e = v16_exp2(_mm512_mul_round_ps(x, _mm512_set1_ps(-1.4426950408889634f),
                                                  V16_RNE));
    const __m512 s = _mm512_div_round_ps(x, _mm512_add_round_ps(_mm512_set1_ps(1.0f), e, V16_RNE),
                                         V16_RNE);
    return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_round_ps(bf_round16(s), up, V16_RNE));
}
#endif
#endif
