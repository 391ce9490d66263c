/* The CPU AdamW step of offloadlab, fused: one pass over flat buffers that reads the fp32
 * master weights, both moments and the gradient as it arrived from the GPU (fp32, bf16 or
 * fp16), and writes the master weights, the moments and the low-precision copy of the
 * weights for the trip back — while each element is still in registers.
 *
 * The arithmetic follows torch.optim.AdamW (decoupled weight decay, bias correction):
 *   p = p * (1 - lr * wd)
 *   m = m + (1 - b1) * (g - m)        (fused multiply-add, as torch.lerp_)
 *   v = v * b2 + (1 - b2) * g * g
 *   p = p - (lr / bc1) * (m / (sqrt(v) / sqrt(bc2) + eps))
 * with the moments rounded exactly as torch's CPU kernels round them (fused multiply-adds
 * where lerp_ and addcmul_ use them); the weights agree to within an ulp or two.
 * Built by offloadlab.cpu_adam with -O3 -fopenmp -fno-math-errno -ffp-contract=off; no
 * fast-math and no implicit contraction, so every other operation rounds as IEEE says.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { KIND_NONE = 0, KIND_F32 = 1, KIND_BF16 = 2, KIND_F16 = 3 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest, ties to even */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);  /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#define ADAMW_LOOP(LOAD_GRAD, STORE_OUT)                                                  \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                    \
    for (int64_t i = 0; i < n; i++) {                                                     \
        float g = (LOAD_GRAD) * grad_scale;                                               \
        float p = param[i] * decay;                                                       \
        float mi = fmaf(one_minus_b1, g - m[i], m[i]);  /* torch lerp_: a fused multiply-add */ \
        float vi = fmaf(one_minus_b2 * g, g, v[i] * beta2);  /* torch addcmul_: fused */  \
        float denom = sqrtf(vi) / bc2_sqrt + eps;                                         \
        p = p + neg_step_size * (mi / denom);                                             \
        m[i] = mi;                                                                        \
        v[i] = vi;                                                                        \
        param[i] = p;                                                                     \
        STORE_OUT;                                                                        \
    }

/* The coefficients arrive precomputed in double precision and rounded once to float, as
 * torch does with Python scalars: decay = 1 - lr*wd, neg_step_size = -lr / (1 - b1^t),
 * bc2_sqrt = sqrt(1 - b2^t). */
void offloadlab_adamw(float *restrict param, float *restrict m, float *restrict v,
                      const void *restrict grad, int grad_kind, void *restrict out, int out_kind,
                      int64_t n, float decay, float one_minus_b1, float beta2, float one_minus_b2,
                      float eps, float bc2_sqrt, float neg_step_size, float grad_scale, int threads) {
    const float *g32 = (const float *)grad;
    const uint16_t *g16 = (const uint16_t *)grad;
    const _Float16 *gh = (const _Float16 *)grad;
    uint16_t *o16 = (uint16_t *)out;
    _Float16 *oh = (_Float16 *)out;
    float *o32 = (float *)out;
    if (threads < 1) threads = 1;

    if (grad_kind == KIND_BF16 && out_kind == KIND_BF16) {
        ADAMW_LOOP(bf16_to_f32(g16[i]), o16[i] = f32_to_bf16(p))
    } else if (grad_kind == KIND_F16 && out_kind == KIND_F16) {
        ADAMW_LOOP((float)gh[i], oh[i] = (_Float16)p)
    } else if (grad_kind == KIND_F32 && out_kind == KIND_F32) {
        ADAMW_LOOP(g32[i], o32[i] = p)
    } else if (grad_kind == KIND_F32 && out_kind == KIND_NONE) {
        ADAMW_LOOP(g32[i], (void)0)
    } else if (grad_kind == KIND_F32 && out_kind == KIND_BF16) {
        ADAMW_LOOP(g32[i], o16[i] = f32_to_bf16(p))
    } else if (grad_kind == KIND_F32 && out_kind == KIND_F16) {
        ADAMW_LOOP(g32[i], oh[i] = (_Float16)p)
    } else if (grad_kind == KIND_BF16 && out_kind == KIND_NONE) {
        ADAMW_LOOP(bf16_to_f32(g16[i]), (void)0)
    } else if (grad_kind == KIND_F16 && out_kind == KIND_NONE) {
        ADAMW_LOOP((float)gh[i], (void)0)
    }
}

/* Sum of squares of a gradient buffer in double precision (for clipping and overflow checks). */
double offloadlab_sumsq(const void *restrict grad, int grad_kind, int64_t n, int threads) {
    double total = 0.0;
    const float *g32 = (const float *)grad;
    const uint16_t *g16 = (const uint16_t *)grad;
    const _Float16 *gh = (const _Float16 *)grad;
    if (threads < 1) threads = 1;
    if (grad_kind == KIND_BF16) {
        #pragma omp parallel for num_threads(threads) reduction(+:total) schedule(static)
        for (int64_t i = 0; i < n; i++) { double g = bf16_to_f32(g16[i]); total += g * g; }
    } else if (grad_kind == KIND_F16) {
        #pragma omp parallel for num_threads(threads) reduction(+:total) schedule(static)
        for (int64_t i = 0; i < n; i++) { double g = (float)gh[i]; total += g * g; }
    } else {
        #pragma omp parallel for num_threads(threads) reduction(+:total) schedule(static)
        for (int64_t i = 0; i < n; i++) { double g = g32[i]; total += g * g; }
    }
    return total;
}
