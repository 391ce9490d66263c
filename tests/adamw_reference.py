"""torch.optim.AdamW's arithmetic, operation for operation, and the inputs the kernel's tests use.

Which of torch's CPU kernels run (and so whether lerp_ and addcmul_ fuse their multiply-add)
is fixed per process by ``ATEN_CPU_CAPABILITY``, so the tests compute the references here, in a
subprocess per capability: ``python -m tests.adamw_reference CAPABILITY INPUTS.pt OUT.pt``. The
inputs travel in a file: torch's random normals and powers differ between its kernels too.
"""

import sys

import torch

# Two hyperparameter sets: the usual betas (lerp_ takes its small-weight branch), and a
# beta1 below 0.5 (its other branch), without weight decay and with a gradient scale.
CASES = {
    "usual": dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8, grad_scale=1.0),
    "low beta1, scaled": dict(
        lr=3e-3, weight_decay=0.0, betas=(0.3, 0.95), eps=1e-6, grad_scale=0.25
    ),
}
SIZE, STEPS = 20_011, 8  # not a multiple of any vector width or tile


def inputs(dtype=torch.float32):
    """Start weights and per-step gradients whose magnitudes span 1e-6 to 1e3, some exactly 0."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(SIZE, generator=generator)
    grads = []
    for _ in range(STEPS):
        magnitude = 10.0 ** torch.randint(-6, 4, (SIZE,), generator=generator)
        grad = torch.randn(SIZE, generator=generator) * magnitude
        grad[torch.randint(0, SIZE, (SIZE // 50,), generator=generator)] = 0.0
        grads.append(grad.to(dtype))
    return start, grads


def correctly_rounded_sqrt(t: torch.Tensor) -> torch.Tensor:
    # The square root in double, rounded once to float, is the correctly rounded float square root.
    return t.double().sqrt().float()


def reference(
    start, grads, *, lr, weight_decay, betas, eps, grad_scale, sqrt=correctly_rounded_sqrt
):
    """(weights, exp_avg, exp_avg_sq) after the steps, with _single_tensor_adam's operations.

    ``sqrt=torch.sqrt`` reproduces torch.optim.AdamW exactly; the default rounds the square
    root correctly, as the C kernel does (torch's x86 builds take it from MKL, within an ulp).
    """
    beta1, beta2 = betas
    p, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    for step, grad in enumerate(grads, 1):
        g = grad.float() * grad_scale if grad_scale != 1.0 else grad.float()
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (sqrt(v) / (1 - beta2**step) ** 0.5).add_(eps)
        p.addcdiv_(m, denom, value=-(lr / (1 - beta1**step)))
    return p, m, v


def adamw(start, grads, *, lr, weight_decay, betas, eps, grad_scale):
    """torch.optim.AdamW itself, on the same (scaled, fp32) gradients."""
    weights = start.clone().requires_grad_()
    optimizer = torch.optim.AdamW([weights], lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    for grad in grads:
        weights.grad = grad.float() * grad_scale if grad_scale != 1.0 else grad.float()
        optimizer.step()
    state = optimizer.state[weights]
    return weights.detach(), state["exp_avg"], state["exp_avg_sq"]


def every_16_bit_value(dtype) -> torch.Tensor:
    """All 65,536 values of a 16-bit dtype (bf16 or fp16), NaNs and infinities included."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def floats_where_rounding_is_decided(dtype) -> torch.Tensor:
    """Every value of the 16-bit ``dtype`` as a float, the floats halfway between neighbours and
    one ulp either side, the overflow and underflow edges, signed zeros, infinities, NaNs with
    payloads, float subnormals, and a million random bit patterns (every exponent)."""
    values = every_16_bit_value(dtype).float()
    finite = values[values.isfinite()].unique()  # sorted, -0 and +0 once
    midpoints = (finite[:-1].double() + finite[1:].double()).div(2).float()  # exact: one more bit
    assert torch.equal(midpoints.double(), (finite[:-1].double() + finite[1:].double()) / 2)
    largest, below = finite[-1].item(), finite[-2].item()
    overflow = largest + (largest - below) / 2  # exact in float; rounds to infinity from here up
    edges = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            overflow,
            -overflow,
            2.0**-14,
            2.0**-24,
            2.0**-25,
            3 * 2.0**-25,
            2.0**-126,
            3.4e38,
            65504.0,
            65520.0,
            65536.0,
            1e-30,
        ]
    )
    assert edges[4].item() == overflow
    near = torch.cat([midpoints, edges])
    up, down = torch.full_like(near, float("inf")), torch.full_like(near, float("-inf"))
    patterns = (
        torch.tensor(
            [
                0x7FC00000,
                0x7F800001,
                0xFFC00001,
                0x7FBFFFFF,
                0x7FE00000,
                0x7F802000,
                0x00000001,
                0x007FFFFF,
                0x80000001,
                0x7F7FFFFF,
            ],
            dtype=torch.int64,
        )
        .to(torch.int32)
        .view(torch.float32)
    )
    random = (
        torch.randint(
            -(2**31), 2**31, (2**20,), generator=torch.Generator().manual_seed(0), dtype=torch.int64
        )
        .to(torch.int32)
        .view(torch.float32)
    )
    return torch.cat([values, near, near.nextafter(up), near.nextafter(down), patterns, random])


def main(capability: str, inputs_file: str, out: str) -> None:
    """Save AdamW's results and both references for every case and every gradient dtype of
    ``inputs_file`` ({dtype: (start, grads)}), with torch's kernels for ``capability``."""
    results = {"capability": torch.backends.cpu.get_cpu_capability().lower()}
    for dtype, (start, grads) in torch.load(inputs_file).items():
        for name, hyper in CASES.items():
            results[name, dtype] = {
                "adamw": adamw(start, grads, **hyper),
                "torch sqrt": reference(start, grads, **hyper, sqrt=torch.sqrt),
                "exact sqrt": reference(start, grads, **hyper),
            }
    torch.save(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
