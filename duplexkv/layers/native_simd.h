/* Vector helpers shared by the kernels (AVX-512 builds only).
 *
 * v16_exp2: 2^x for 16 floats by a polynomial of our own (the same instructions for every lane
 * and every call, so a value's result never depends on its neighbours or on which kernel asks):
 * x = n + f, n an integer and |f| <= 0.5, 2^f by its Taylor series to degree 6 (relative error
 * ~1e-7 over the range, 2^0 = 1 exactly), then scaled by 2^n. Inputs below -126 give 2^-126 (a
 * caller masks what must be exactly zero); large inputs overflow to infinity. Every step is a
 * builtin the compiler may not reassociate under -ffast-math (FMAs, an explicitly rounded sub).
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
#endif
