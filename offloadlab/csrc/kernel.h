/* What the per-instruction-set copies of cpu_adam.c and the dispatcher (dispatch.c) share.
 *
 * cpu_adam.c is compiled once per variant, with that variant's instruction-set flags and
 * -DOFFLOADLAB_VARIANT=<name>; VARIANT_FUNCTION gives each copy's functions their own names
 * (offloadlab_adamw_avx2, ...) so that all copies link into one library.
 */
#ifndef OFFLOADLAB_KERNEL_H
#define OFFLOADLAB_KERNEL_H

#include <stdint.h>

/* Element types of the gradient and of the low-precision copy of the weights. */
enum { KIND_NONE = 0, KIND_F32 = 1, KIND_BF16 = 2, KIND_F16 = 3 };

/* The gradient and copy types the kernel has loops for: every pair of these. */
static inline int adamw_kinds_supported(int grad_kind, int out_kind) {
    return grad_kind >= KIND_F32 && grad_kind <= KIND_F16 && out_kind >= KIND_NONE && out_kind <= KIND_F16;
}

/* What the entry points return: 0, or why they did nothing. */
enum { STATUS_OK = 0, STATUS_BAD_KIND = 1, STATUS_BAD_VARIANT = 2, STATUS_CPU_LACKS_VARIANT = 3, STATUS_NO_MEMORY = 4 };

/* The scalars of one AdamW step, each computed in double precision by the caller and rounded
 * once to float, as torch rounds a Python number it applies to a float32 tensor. */
struct adamw_coefficients {
    float decay;          /* 1 - lr * weight_decay */
    float lerp_weight;    /* 1 - beta1 */
    float beta2;
    float one_minus_b2;   /* 1 - beta2 */
    float eps;
    float bc2_sqrt;       /* (1 - beta2^step) ** 0.5 */
    float neg_step_size;  /* -lr / (1 - beta1^step) */
    float grad_scale;     /* the gradient is multiplied by this first (1 / loss scale, a clip factor) */
};

#define ADAMW_PARAMETERS                                                                     \
    float *restrict param, float *restrict exp_avg, float *restrict exp_avg_sq,              \
    const void *restrict grad, int grad_kind, void *restrict out, int out_kind, int64_t n,   \
    const struct adamw_coefficients *coefficients, int threads
#define SUMSQ_PARAMETERS const void *restrict grad, int grad_kind, int64_t n, int threads, double *result
/* The floor's: the step's arrays and threads, no coefficients (cpu_adam.c's offloadlab_floor). */
#define FLOOR_PARAMETERS                                                                     \
    float *restrict param, float *restrict exp_avg, float *restrict exp_avg_sq,              \
    const void *restrict grad, int grad_kind, void *restrict out, int out_kind, int64_t n, int threads

/* The library exports only dispatch.c's entry points (everything is built with
 * -fvisibility=hidden): a caller cannot reach a copy without the CPU check in front of it. */
#define EXPORT __attribute__((visibility("default")))

#define GLUE_(a, b) a##_##b
#define GLUE(a, b) GLUE_(a, b)
#ifdef OFFLOADLAB_VARIANT
#define VARIANT_FUNCTION(name) GLUE(name, OFFLOADLAB_VARIANT)
#endif

#endif
