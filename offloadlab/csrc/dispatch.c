/* The library's entry points: which copies of the kernel it holds, which of them this CPU
 * can run, and calls into the one the caller names.
 *
 * Compiled with no instruction-set flags, so the library loads and answers on any CPU of its
 * architecture; the copies of cpu_adam.c for wider instruction sets are only ever entered
 * after the checks below have found every instruction set their flags enable, and the
 * operating system's support for the registers they use.
 *
 * The build defines OFFLOADLAB_VARIANTS as X(name) for each copy, best first, from the one
 * recipe in offloadlab/kernel_build.py; each name needs a runs_<name> check here.
 */
#include "kernel.h"

#ifndef OFFLOADLAB_VARIANTS
#error "define OFFLOADLAB_VARIANTS as X(name) per variant, best first (offloadlab/kernel_build.py does)"
#endif
#ifndef OFFLOADLAB_SOURCE_DIGEST
#error "define OFFLOADLAB_SOURCE_DIGEST as the quoted digest of the sources (offloadlab/kernel_build.py does)"
#endif

#if defined(__x86_64__)
#include <cpuid.h>

/* XCR0: the register states the operating system saves and restores across context switches. */
static uint64_t enabled_register_states(void) {
    uint32_t low, high;
    __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
    return ((uint64_t)high << 32) | low;
}

static int runs_baseline(void) { return 1; } /* SSE2: part of x86-64 */

/* -mavx2 -mfma -mf16c, and the SSE levels and POPCNT that -mavx2 implies. */
static int runs_avx2(void) {
    unsigned eax, ebx, ecx, edx;
    const unsigned leaf1 = bit_SSE3 | bit_SSSE3 | bit_FMA | bit_SSE4_1 | bit_SSE4_2 | bit_POPCNT | bit_OSXSAVE |
                           bit_AVX | bit_F16C;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || (ecx & leaf1) != leaf1) return 0;
    if ((enabled_register_states() & 0x6) != 0x6) return 0; /* XMM and YMM */
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
    return (ebx & bit_AVX2) != 0;
}

/* Everything runs_avx2 needs, and -mavx512f -mavx512bw -mavx512dq -mavx512vl (not every
 * AVX-512 CPU has all four: Xeon Phi has F without BW, DQ and VL). */
static int runs_avx512(void) {
    unsigned eax, ebx, ecx, edx;
    const unsigned leaf7 = bit_AVX512F | bit_AVX512DQ | bit_AVX512BW | bit_AVX512VL;
    if (!runs_avx2() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || (ebx & leaf7) != leaf7) return 0;
    return (enabled_register_states() & 0xe6) == 0xe6; /* + opmask, upper ZMM0-15, ZMM16-31 */
}

#elif defined(__aarch64__)

static int runs_neon(void) { return 1; } /* Advanced SIMD and FMA: part of every AArch64 CPU */

#else

static int runs_portable(void) { return 1; } /* plain C for the architecture's baseline */

#endif

#define X(name)                                                                                       \
    int offloadlab_adamw_##name(ADAMW_PARAMETERS);                                                    \
    int offloadlab_sumsq_##name(SUMSQ_PARAMETERS);                                                    \
    int offloadlab_floor_##name(FLOOR_PARAMETERS);
OFFLOADLAB_VARIANTS
#undef X

static const struct variant {
    const char *name;
    int (*runs)(void);
    int (*adamw)(ADAMW_PARAMETERS);
    int (*sumsq)(SUMSQ_PARAMETERS);
    int (*floor)(FLOOR_PARAMETERS);
} variants[] = {
#define X(name) {#name, runs_##name, offloadlab_adamw_##name, offloadlab_sumsq_##name, offloadlab_floor_##name},
    OFFLOADLAB_VARIANTS
#undef X
};

enum { VARIANT_COUNT = sizeof variants / sizeof variants[0] };

/* Found once, when the library is loaded (CPUID can cost microseconds in a virtual machine). */
static int runnable[VARIANT_COUNT];

__attribute__((constructor)) static void find_runnable_variants(void) {
    for (int v = 0; v < VARIANT_COUNT; v++) runnable[v] = variants[v].runs();
}

EXPORT const char *offloadlab_source_digest(void) { return OFFLOADLAB_SOURCE_DIGEST; }

EXPORT int offloadlab_variant_count(void) { return VARIANT_COUNT; }

EXPORT const char *offloadlab_variant_name(int variant) {
    return variant >= 0 && variant < VARIANT_COUNT ? variants[variant].name : 0;
}

EXPORT int offloadlab_variant_runs_here(int variant) {
    return variant >= 0 && variant < VARIANT_COUNT && runnable[variant];
}

EXPORT int offloadlab_adamw_supports(int grad_kind, int out_kind) { return adamw_kinds_supported(grad_kind, out_kind); }

static int check_variant(int variant) {
    if (variant < 0 || variant >= VARIANT_COUNT) return STATUS_BAD_VARIANT;
    return runnable[variant] ? STATUS_OK : STATUS_CPU_LACKS_VARIANT;
}

EXPORT int offloadlab_adamw(int variant, ADAMW_PARAMETERS) {
    int status = check_variant(variant);
    if (status != STATUS_OK) return status;
    return variants[variant].adamw(param, exp_avg, exp_avg_sq, grad, grad_kind, out, out_kind, n, coefficients,
                                   threads);
}

EXPORT int offloadlab_sumsq(int variant, SUMSQ_PARAMETERS) {
    int status = check_variant(variant);
    if (status != STATUS_OK) return status;
    return variants[variant].sumsq(grad, grad_kind, n, threads, result);
}

EXPORT int offloadlab_floor(int variant, FLOOR_PARAMETERS) {
    int status = check_variant(variant);
    if (status != STATUS_OK) return status;
    return variants[variant].floor(param, exp_avg, exp_avg_sq, grad, grad_kind, out, out_kind, n, threads);
}
