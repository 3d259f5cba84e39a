/* Vector helpers shared by the kernels (AVX-512 builds; at the end, the AVX2 builds' few).
 *
 * v16_exp2: 2^x for 16 floats by a polynomial of our own (the same instructions for every lane
 * and every call, so a value's result never depends on its neighbours or on which kernel asks):
 * x = n + f, n an integer and |f| <= 0.5, 2^f by its Taylor series to degree 6 (relative error
 * ~1e-7 over the range, 2^0 = 1 exactly), then scaled by 2^n. Inputs below -126 give 2^-126 (a
 * caller masks what must be exactly zero); large inputs overflow to infinity. Every step is a
 * builtin the compiler may not reassociate under -ffast-math (FMAs, an explicitly rounded sub).
 *
 * v16_transpose16: a 16 x 16 matrix of 32-bit elements transposed in registers (the AMX
 * attention's key packing, the float32 prefill attention's).
 *
 * v16_silu_mul: bf16(bf16(silu(x)) * up) for bf16 values x and up (as floats), the one formula of
 * the bf16 SiLU kernel (native_bf16.h) and of the AMX linear's fused gate/up epilogue
 * (native_amx.h), so both give the same bits: every step explicitly rounded, e^-x by v16_exp2.
 */
/* what the packed bf16 linears write (bf16_pair_store; defined on every build, the kernels'
 * signatures carry it) */
#define BF_OUT_BF16 0 /* y [M, N] bf16 */
#define BF_OUT_SILU 1 /* the fused gate/up's bf16(bf16(silu(gate)) * up), y [M, N / 2] bf16 */
#define BF_OUT_F32 2  /* y [M, N] float32: each bf16 result widened */

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

/* 2^f for |f| <= 0.5: Taylor coefficients, highest degree first */
static const float EXP2_C[7] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f,
                                2.4022651e-1f, 6.9314718e-1f, 1.0f};
#endif

#if defined(__AVX512F__)
static inline __m512 v16_exp2(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_round_ps(x, n, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(EXP2_C[0]);
    for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C[i]));
    return _mm512_scalef_ps(p, n);
}

/* lane r (0 .. 7) <- the largest of a[r]'s 16 lanes (lanes 8 .. 15: undefined): halves, then
 * quarters of two vectors folded together, so eight maxima cost 24 instructions, not 8 trees */
static inline __m512 v16_rowmax8(const __m512 a[8]) {
    __m512 h[4], q[2];
    for (int i = 0; i < 4; i++) /* h[i]: a[2i] folded to lanes 0-7, a[2i+1] to lanes 8-15 */
        h[i] = _mm512_max_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee));
    for (int i = 0; i < 2; i++) /* q[i]: quarter k holds row 4i + k folded to 4 lanes */
        q[i] = _mm512_max_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], 0xdd));
    /* quarter k: lanes (row k, row k, row 4+k, row 4+k), then one lane each */
    __m512 t = _mm512_max_ps(_mm512_shuffle_ps(q[0], q[1], 0x44), _mm512_shuffle_ps(q[0], q[1], 0xee));
    t = _mm512_max_ps(t, _mm512_permute_ps(t, 0xb1));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0), t);
}

/* r[j][n] <- r[n][j] for a 16 x 16 matrix of 32-bit elements */
static inline void v16_transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* each 128-bit lane now holds a 4 x 4 block transposed; the lanes themselves are next */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
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

/* The packed bf16 linears' epilogue (native_amx.h, native_vdp.h): column pair q (32 columns) of
 * rows m0 .. m0 + rows - 1, row r's float32 sums at c + r * ld. BF_OUT_SILU: gate (columns
 * 0..15) and up (16..31) -> v16_silu_mul at y[m0 + r, 16q ..] of a [M, N / 2] bf16 output; else +
 * bias (float32, or NULL), one rounding to bf16, at y[m0 + r, 32q ..], nothing past column N:
 * stored as bf16 (BF_OUT_BF16) or widened back to float32 (BF_OUT_F32: the bits of the bf16
 * output's .float(), without a second pass over the output). */
static inline void bf16_pair_store(void *y, int64_t m0, int64_t rows, int64_t N, int64_t q,
                                   const float *bias, int out, const float *c, int64_t ld) {
    if (out == BF_OUT_SILU) {
        for (int64_t r = 0; r < rows; r++)
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + (m0 + r) * (N / 2) + 16 * q),
                                v16_silu_mul(bf_round16(_mm512_load_ps(c + r * ld)),
                                             bf_round16(_mm512_load_ps(c + r * ld + 16))));
        return;
    }
    const int64_t n0 = q * 32, cols = N - n0 < 32 ? N - n0 : 32;
    const __mmask32 keep = cols == 32 ? 0xffffffffu : (1u << cols) - 1;
    __m512 b_lo = _mm512_setzero_ps(), b_hi = _mm512_setzero_ps();
    if (bias) {
        b_lo = _mm512_maskz_loadu_ps((__mmask16)keep, bias + n0);
        b_hi = _mm512_maskz_loadu_ps((__mmask16)(keep >> 16), bias + n0 + 16);
    }
    for (int64_t r = 0; r < rows; r++) {
        const __m512 lo = _mm512_add_ps(_mm512_load_ps(c + r * ld), b_lo);
        const __m512 hi = _mm512_add_ps(_mm512_load_ps(c + r * ld + 16), b_hi);
        if (out == BF_OUT_F32) {
            float *o = (float *)y + (m0 + r) * N + n0;
            _mm512_mask_storeu_ps(o, (__mmask16)keep, bf_round16(lo));
            _mm512_mask_storeu_ps(o + 16, (__mmask16)(keep >> 16), bf_round16(hi));
        } else {
            _mm512_mask_storeu_epi16((uint16_t *)y + (m0 + r) * N + n0, keep,
                                     (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}
#endif
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* The AVX2 builds' helpers (native_f32_prefill.h's 8-float tiles). */

/* v stays in a register from here on: the empty asm hides where its value came from, so the
 * compiler cannot fold its later uses back into memory operands (with the 16 registers short, GCC
 * re-read a vector from L1 for every FMA that used it: the few-row linear's x, the value rows of
 * the one-pass decode attention) */
#define V8_PIN(v) __asm__("" : "+x"(v))

/* 2^x for 8 floats, x <= 0 (scores minus a running maximum): the polynomial of v16_exp2, the
 * power of two built in the exponent bits (inputs below -126 give 2^-126, a caller masks what
 * must be exactly zero) */
static inline __m256 v8_exp2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(EXP2_C[0]);
    for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float v8_hmax(__m256 a) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* r[j][n] <- r[n][j] for an 8 x 8 matrix of floats */
static inline void v8_transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* columns (k, k + 4) of rows i .. i + 3, k = 0 .. 3 */
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x20);
        r[k + 4] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x31);
    }
}
#endif
