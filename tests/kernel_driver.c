/* Runs a kernel library's offloadlab_adamw on inputs from a file and writes the results: the
 * test of the AArch64 build, which runs this under qemu-aarch64 on an x86-64 machine.
 *
 * Input: int64 n, steps, grad_kind, out_kind; float32 master[n], exp_avg[n], exp_avg_sq[n];
 * then per step: the 8 float32 coefficients (struct adamw_coefficients) and the gradient.
 * Output: master, exp_avg, exp_avg_sq, and the copy if out_kind is not 0.
 * Usage: arm_driver LIBRARY INPUT OUTPUT
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef int (*adamw_fn)(int, float *, float *, float *, const void *, int, void *, int, int64_t, const float *, int);

static void read_exactly(void *buffer, size_t size, size_t count, FILE *file) {
    if (fread(buffer, size, count, file) != count) {
        fprintf(stderr, "arm_driver: input too short\n");
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc != 4) return fprintf(stderr, "usage: arm_driver LIBRARY INPUT OUTPUT\n"), 2;
    void *library = dlopen(argv[1], RTLD_NOW);
    if (!library) return fprintf(stderr, "arm_driver: %s\n", dlerror()), 1;
    adamw_fn adamw = (adamw_fn)dlsym(library, "offloadlab_adamw");
    FILE *in = fopen(argv[2], "rb"), *out = fopen(argv[3], "wb");
    if (!adamw || !in || !out) return fprintf(stderr, "arm_driver: no entry point, input or output\n"), 1;
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
        int status = adamw(0, param, exp_avg, exp_avg_sq, grad, grad_kind, out_kind ? copy : NULL, out_kind, n,
                           coefficients, 2);
        if (status) return fprintf(stderr, "arm_driver: offloadlab_adamw returned %d\n", status), 1;
    }
    fwrite(param, 4, n, out);
    fwrite(exp_avg, 4, n, out);
    fwrite(exp_avg_sq, 4, n, out);
    if (out_kind) fwrite(copy, out_size, n, out);
    return fclose(out) != 0;
}
