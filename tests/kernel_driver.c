/* Runs a kernel library's entry points outside Python, for the tests that run the library
 * under qemu: the AArch64 build on this machine, and the x86-64 build on emulated CPUs that
 * lack some of its instruction sets.
 *
 *   kernel_driver LIBRARY                          one line per variant: "name 1" if this CPU
 *                                                  runs it, "name 0" if not
 *   kernel_driver LIBRARY VARIANT INPUT OUTPUT     AdamW steps with variant number VARIANT;
 *                                                  exit status 3 if the library refused them
 *
 * INPUT: int64 n, steps, grad_kind, out_kind; float32 master[n], exp_avg[n], exp_avg_sq[n];
 * then per step the 8 float32 coefficients (struct adamw_coefficients) and the gradient.
 * OUTPUT: master, exp_avg, exp_avg_sq, and the copy if out_kind is not 0.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef int (*adamw_fn)(int, float *, float *, float *, const void *, int, void *, int, int64_t, const float *, int);

static void read_exactly(void *buffer, size_t size, size_t count, FILE *file) {
    if (fread(buffer, size, count, file) != count) {
        fprintf(stderr, "kernel_driver: input too short\n");
        exit(1);
    }
}

static int list_variants(void *library) {
    int (*count)(void) = (int (*)(void))dlsym(library, "offloadlab_variant_count");
    const char *(*name)(int) = (const char *(*)(int))dlsym(library, "offloadlab_variant_name");
    int (*runs_here)(int) = (int (*)(int))dlsym(library, "offloadlab_variant_runs_here");
    if (!count || !name || !runs_here) return fprintf(stderr, "kernel_driver: no variant table\n"), 1;
    for (int v = 0; v < count(); v++) printf("%s %d\n", name(v), runs_here(v));
    return 0;
}

static int run_steps(void *library, int variant, const char *input, const char *output) {
    adamw_fn adamw = (adamw_fn)dlsym(library, "offloadlab_adamw");
    FILE *in = fopen(input, "rb"), *out = fopen(output, "wb");
    if (!adamw || !in || !out) return fprintf(stderr, "kernel_driver: no entry point, input or output\n"), 1;
    int64_t header[4];
    read_exactly(header, sizeof header[0], 4, in);
    int64_t n = header[0], steps = header[1];
    int grad_kind = (int)header[2], out_kind = (int)header[3];
    size_t grad_size = grad_kind == 1 ? 4 : 2, out_size = out_kind == 1 ? 4 : 2;
    float *param = malloc(n * 4), *exp_avg = malloc(n * 4), *exp_avg_sq = malloc(n * 4), coefficients[8];
    void *grad = malloc(n * grad_size), *copy = malloc(n * out_size);
    read_exactly(param, 4, n, in);
    read_exactly(exp_avg, 4, n, in);
    read_exactly(exp_avg_sq, 4, n, in);
    for (int64_t step = 0; step < steps; step++) {
        read_exactly(coefficients, 4, 8, in);
        read_exactly(grad, grad_size, n, in);
        int status = adamw(variant, param, exp_avg, exp_avg_sq, grad, grad_kind, out_kind ? copy : NULL, out_kind,
                           n, coefficients, 2);
        if (status) return fprintf(stderr, "kernel_driver: offloadlab_adamw returned %d\n", status), 3;
    }
    fwrite(param, 4, n, out);
    fwrite(exp_avg, 4, n, out);
    fwrite(exp_avg_sq, 4, n, out);
    if (out_kind) fwrite(copy, out_size, n, out);
    return fclose(out) != 0;
}

int main(int argc, char **argv) {
    if (argc != 2 && argc != 5)
        return fprintf(stderr, "usage: kernel_driver LIBRARY [VARIANT INPUT OUTPUT]\n"), 2;
    void *library = dlopen(argv[1], RTLD_NOW);
    if (!library) return fprintf(stderr, "kernel_driver: %s\n", dlerror()), 1;
    return argc == 2 ? list_variants(library) : run_steps(library, atoi(argv[2]), argv[3], argv[4]);
}
