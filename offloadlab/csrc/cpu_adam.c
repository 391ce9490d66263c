/* The CPU AdamW step of offloadlab, fused: one pass over flat buffers that reads the fp32
 * master weights, both moments and the gradient as it arrived from the GPU (fp32, bf16 or
 * fp16), and writes the master weights, the moments and, optionally, a copy of the weights
 * in fp32, bf16 or fp16 for the trip back — every pair of gradient and copy type.
 *
 * The arithmetic is torch.optim.AdamW's (decoupled weight decay, bias correction), operation
 * for operation and rounded as torch's CPU kernels round it:
 *   p = p * decay                                       (param.mul_)
 *   m = m + w * (g - m)          for w < 0.5            (exp_avg.lerp_(g, w), w = 1 - beta1)
 *   m = g - (1 - w) * (g - m)    otherwise
 *   v = v * beta2;  v = v + ((1 - beta2) * g) * g        (exp_avg_sq.mul_().addcmul_())
 *   d = sqrt(v) / bc2_sqrt;  d = d + eps                 (sqrt, div, add_)
 *   p = p + (neg_step_size * m) / d                      (param.addcdiv_)
 * Where torch's kernels fuse a multiply and an add, so does this one: torch's vectorised
 * kernels for CPUs with FMA (its AVX2 and AVX512 builds, and Arm) round lerp's and addcmul's
 * multiply-add once; its DEFAULT build for x86-64 without FMA rounds twice. MULADD follows
 * the instruction set this copy is compiled for. Compiled with -ffp-contract=off and without
 * fast-math, so nothing else is fused or reordered. The square root is correctly rounded;
 * torch's x86 builds take MKL's, which is an ulp off at times (so are the weights, then).
 *
 * This file is compiled once per instruction-set variant (see kernel.h and
 * offloadlab/kernel_build.py); dispatch.c picks one the running CPU supports.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernel.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

/* The build names the variant; check that its flags gave the instructions the code counts on
 * (and no more, for the baseline: dispatch.c lets every x86-64 CPU run it). */
#if defined(OFFLOADLAB_VARIANT_AVX512) && \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
      defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "the avx512 variant needs -mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx2 -mfma -mf16c"
#endif
#if defined(OFFLOADLAB_VARIANT_AVX2) && \
    (!(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) || defined(__AVX512F__))
#error "the avx2 variant needs -mavx2 -mfma -mf16c and no AVX-512"
#endif
#if defined(OFFLOADLAB_VARIANT_BASELINE) && (defined(__AVX__) || defined(__FMA__) || defined(__F16C__))
#error "the baseline variant is for any x86-64 CPU: remove -march and -m flags from CC"
#endif

#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define MULADD(a, b, c) fmaf((a), (b), (c)) /* one rounding: a hardware fused multiply-add */
#else
#define MULADD(a, b, c) ((a) * (b) + (c))   /* two roundings, as torch's kernels without FMA */
#endif

/* Elements per tile: a thread converts a tile of gradient into fp32 on its stack, updates it,
 * and converts the weights out, while the tile is in L1 (3 × 4 KiB). */
#define TILE 1024
/* Elements per thread at least, as torch's grain size: waking a thread costs microseconds
 * (hundreds on a busy machine), more than a small slice's whole step. */
#define GRAIN (32 * TILE)

static inline int threads_for(int64_t n, int threads) {
    int64_t useful = n / GRAIN > 1 ? n / GRAIN : 1;
    return threads < 1 ? 1 : threads > useful ? (int)useful : threads;
}

static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---- bf16: the upper half of an fp32; exact software conversions in every variant ---- */

static void bf16_to_f32(const uint16_t *restrict src, float *restrict dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = bits_float((uint32_t)src[i] << 16);
}

#if defined(__SSE2__) && !defined(__AVX2__)
/* x86-64 without AVX2 (the baseline copy): SSE2 has no unsigned 32-to-16-bit pack, and the
 * compiler narrows with a long shuffle sequence. Shifting right arithmetically instead leaves
 * each rounded high half sign-extended, which the signed pack then takes exactly: the same
 * bits as the loop below, and the baseline's bf16 step 10 % faster. */
#include <emmintrin.h>

static inline __m128i bf16_sign_extended(__m128 f) {
    __m128i x = _mm_castps_si128(f);
    __m128i odd = _mm_and_si128(_mm_srli_epi32(x, 16), _mm_set1_epi32(1));
    __m128i rounded = _mm_add_epi32(_mm_add_epi32(x, _mm_set1_epi32(0x7fff)), odd);
    __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(f, f));
    __m128i quiet_nan = _mm_or_si128(x, _mm_set1_epi32(0x400000));
    return _mm_srai_epi32(_mm_or_si128(_mm_and_si128(nan, quiet_nan), _mm_andnot_si128(nan, rounded)), 16);
}
#endif

/* Round to nearest, ties to even; a NaN stays a NaN (quiet, sign and top payload kept). */
static void f32_to_bf16(const float *restrict src, uint16_t *restrict dst, int64_t n) {
    int64_t i = 0;
#if defined(__SSE2__) && !defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        __m128i low = bf16_sign_extended(_mm_loadu_ps(src + i)), high = bf16_sign_extended(_mm_loadu_ps(src + i + 4));
        _mm_storeu_si128((__m128i *)(dst + i), _mm_packs_epi32(low, high));
    }
#endif
    for (; i < n; i++) {
        uint32_t x = float_bits(src[i]);
        uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
        dst[i] = (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? (x >> 16) | 0x40u : rounded);
    }
}

/* ---- fp16: F16C instructions where the variant has them, else exact software ---- */

#if defined(__F16C__)

static void f16_to_f32(const uint16_t *restrict src, float *restrict dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = _cvtsh_ss(src[i]);
}

static void f32_to_f16(const float *restrict src, uint16_t *restrict dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = (uint16_t)_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

#elif defined(__aarch64__)

/* __fp16 is Arm's storage type for IEEE half; the conversions are single instructions. */
static void f16_to_f32(const uint16_t *restrict src, float *restrict dst, int64_t n) {
    const __fp16 *half = (const __fp16 *)src;
    for (int64_t i = 0; i < n; i++) dst[i] = half[i];
}

static void f32_to_f16(const float *restrict src, uint16_t *restrict dst, int64_t n) {
    __fp16 *half = (__fp16 *)dst;
    for (int64_t i = 0; i < n; i++) half[i] = (__fp16)src[i];
}

#else

/* Exact in every case, branch-free so the compiler vectorises it, and independent of the
 * thread's flush-to-zero setting (no subnormal float is ever an operand or a result). A NaN
 * keeps its sign and payload (the first arithmetic on it makes it quiet, as F16C does). */
static void f16_to_f32(const uint16_t *restrict src, float *restrict dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t h = src[i];
        uint32_t sign = (h & 0x8000u) << 16, magnitude = h & 0x7fffu, mantissa = h & 0x3ffu;
        uint32_t normal = (magnitude << 13) + ((127u - 15u) << 23);
        uint32_t special = 0x7f800000u | (mantissa << 13);  /* infinity or NaN */
        uint32_t tiny = float_bits((float)mantissa * 0x1p-24f);  /* subnormal half or zero */
        uint32_t bits = magnitude >= 0x7c00u ? special : magnitude >= 0x0400u ? normal : tiny;
        dst[i] = bits_float(bits | sign);
    }
}

/* Round to nearest, ties to even; too large for half becomes infinity. */
static void f32_to_f16(const float *restrict src, uint16_t *restrict dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t x = float_bits(src[i]);
        uint32_t sign = (x >> 16) & 0x8000u, magnitude = x & 0x7fffffffu;
        /* normal half: rebias the exponent and round the 13 dropped bits to nearest even */
        uint32_t normal = (magnitude + ((15u - 127u) << 23) + 0xfffu + ((magnitude >> 13) & 1u)) >> 13;
        /* below 2^-14: adding 0.5 aligns the value to half's subnormal step and rounds it
           (ties to even) in the addition itself; the half's bits are the low mantissa bits */
        float magnitude_f = bits_float(magnitude < 0x38800000u ? magnitude : 0u);
        uint32_t subnormal = float_bits(magnitude_f + 0.5f) - 0x3f000000u;
        uint32_t special = magnitude > 0x7f800000u ? 0x7e00u | ((magnitude >> 13) & 0x3ffu) : 0x7c00u;
        uint32_t half = magnitude >= 0x47800000u ? special : magnitude < 0x38800000u ? subnormal : normal;
        dst[i] = (uint16_t)(half | sign);
    }
}

#endif

/* The gradient tile as fp32: in place when it already is, else converted into `scratch`. */
static inline const float *gradient_tile(const void *grad, int kind, int64_t start, int64_t len, float *scratch) {
    if (kind == KIND_F32) return (const float *)grad + start;
    if (kind == KIND_BF16) bf16_to_f32((const uint16_t *)grad + start, scratch, len);
    else f16_to_f32((const uint16_t *)grad + start, scratch, len);
    return scratch;
}

static inline void store_copy(const float *weights, void *out, int kind, int64_t start, int64_t len) {
    if (kind == KIND_F32) memcpy((float *)out + start, weights, (size_t)len * sizeof(float));
    else if (kind == KIND_BF16) f32_to_bf16(weights, (uint16_t *)out + start, len);
    else if (kind == KIND_F16) f32_to_f16(weights, (uint16_t *)out + start, len);
}

static inline void update(float *restrict p, float *restrict m, float *restrict v, const float *restrict g_in,
                          int64_t len, struct adamw_coefficients c) {
    /* torch's lerp: m + w*(g - m) for a small weight, g - (1 - w)*(g - m) for a large one */
    int small = fabsf(c.lerp_weight) < 0.5f;
    float lerp_coefficient = small ? c.lerp_weight : c.lerp_weight - 1.0f;
    for (int64_t i = 0; i < len; i++) {
        float g = g_in[i] * c.grad_scale;
        float pi = p[i] * c.decay;
        float mi = MULADD(lerp_coefficient, g - m[i], small ? m[i] : g);
        float vi = MULADD(c.one_minus_b2 * g, g, v[i] * c.beta2);
        float denom = sqrtf(vi) / c.bc2_sqrt + c.eps;
        p[i] = pi + (c.neg_step_size * mi) / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

int VARIANT_FUNCTION(offloadlab_adamw)(ADAMW_PARAMETERS) {
    if (!adamw_kinds_supported(grad_kind, out_kind)) return STATUS_BAD_KIND;
    const struct adamw_coefficients c = *coefficients;
    threads = threads_for(n, threads);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t start = 0; start < n; start += TILE) {
        _Alignas(64) float scratch[TILE];
        int64_t len = n - start < TILE ? n - start : TILE;
        update(param + start, exp_avg + start, exp_avg_sq + start,
               gradient_tile(grad, grad_kind, start, len, scratch), len, c);
        store_copy(param + start, out, out_kind, start, len);
    }
    return STATUS_OK;
}

/* The floor under the step, for `offloadlab bench adam`: the step's memory traffic with its
 * arithmetic taken out. Each element is read and written where the step reads and writes it
 * (the three fp32 arrays in place, the gradient converted a tile at a time, the copy stored
 * from the tile), in the same tiles and threads, with one add per array so that no load or
 * store can be left out. STREAM's discipline applies where it is timed: best of several
 * passes, on arrays well past the last-level cache. A step that runs faster than this is
 * measuring something else (a warm cache, a slow spell during the floor's passes). */
static inline void floor_tile(float *restrict p, float *restrict m, float *restrict v, const float *restrict g,
                              int64_t len) {
    for (int64_t i = 0; i < len; i++) {
        p[i] += g[i];
        m[i] += g[i];
        v[i] += g[i];
    }
}

int VARIANT_FUNCTION(offloadlab_floor)(FLOOR_PARAMETERS) {
    if (!adamw_kinds_supported(grad_kind, out_kind)) return STATUS_BAD_KIND;
    threads = threads_for(n, threads);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t start = 0; start < n; start += TILE) {
        _Alignas(64) float scratch[TILE];
        int64_t len = n - start < TILE ? n - start : TILE;
        floor_tile(param + start, exp_avg + start, exp_avg_sq + start,
                   gradient_tile(grad, grad_kind, start, len, scratch), len);
        store_copy(param + start, out, out_kind, start, len);
    }
    return STATUS_OK;
}

/* Σ g² in double precision, in an order fixed by n alone: chunks of SUM_CHUNK elements are
 * summed in PARTIALS interleaved partial sums (so the loop vectorises without reassociating
 * anything), and the chunks' sums are added in order — the same bits on every run, for any
 * number of threads, in every variant. */
#define SUM_CHUNK (64 * TILE)
#define PARTIALS 16

static double chunk_sumsq(const void *grad, int kind, int64_t start, int64_t len) {
    double partial[PARTIALS] = {0};
    _Alignas(64) float scratch[TILE];
    for (int64_t tile = start; tile < start + len; tile += TILE) {
        int64_t count = start + len - tile < TILE ? start + len - tile : TILE;
        const float *g = gradient_tile(grad, kind, tile, count, scratch);
        int64_t i = 0;
        for (; i + PARTIALS <= count; i += PARTIALS)
            for (int k = 0; k < PARTIALS; k++) partial[k] += (double)g[i + k] * g[i + k];
        for (int k = 0; i < count; i++, k++) partial[k] += (double)g[i] * g[i];
    }
    double total = 0.0;
    for (int k = 0; k < PARTIALS; k++) total += partial[k];
    return total;
}

int VARIANT_FUNCTION(offloadlab_sumsq)(SUMSQ_PARAMETERS) {
    if (!adamw_kinds_supported(grad_kind, KIND_NONE)) return STATUS_BAD_KIND;
    threads = threads_for(n, threads);
    int64_t chunks = (n + SUM_CHUNK - 1) / SUM_CHUNK;
    double *sums = malloc((size_t)(chunks > 0 ? chunks : 1) * sizeof(double));
    if (sums == NULL) return STATUS_NO_MEMORY;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        int64_t start = chunk * SUM_CHUNK;
        sums[chunk] = chunk_sumsq(grad, grad_kind, start, n - start < SUM_CHUNK ? n - start : SUM_CHUNK);
    }
    double total = 0.0;
    for (int64_t chunk = 0; chunk < chunks; chunk++) total += sums[chunk];
    free(sums);
    *result = total;
    return STATUS_OK;
}
