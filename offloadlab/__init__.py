"""offloadlab: train models larger than GPU memory by offloading state to CPU memory and NVMe.

The package behind the offloadlab textbook and lab kit. It is built in layers, listed in
:data:`LAYERS` from the top down: each module imports only modules of its own layer or of the
layers below it (``tests/test_layers.py`` holds every module to that), and the two lowest — pure
arithmetic and the base — import nothing outside the standard library when they are imported, so
they also run in a browser (the static site's calculators run them in Pyodide). A package (link,
nvme, offload, planner) belongs to its layer with all its modules. Importing offloadlab changes
nothing in torch.
"""

__version__ = "0.1.0"

# layer (top first): its modules. "Reading the package" in the book shows this map with each
# module's job, computed from this very dict.
LAYERS = {
    "face: the command, benchmarks, the GPU kit": ["cli", "bench", "gpucheck", "__main__"],
    "course: figures, lab checks and grading, the student release, JupyterLab's contents": [
        "plots",
        "check",
        "grading",
        "student",
        "lab",
    ],
    "mechanisms: offload, streaming, prefetch, NVMe": [
        "offload",
        "streaming",
        "ownership",
        "prefetch",
        "gather",
        "nvme",
    ],
    "kernel: the CPU AdamW step and its build": ["cpu_adam", "kernel_build"],
    "workload: a model to train, sharded runs": ["models", "distributed"],
    "measurement: what this machine has and does": [
        "probe",
        "ladder",
        "experiment",
        "machine",
        "devices",
        "reference",
    ],
    "transfer engine: copies, events, traces": ["link", "layout", "trace"],
    "torch's private parts: every one the package uses, in one place": ["_torch_compat"],
    "estimates: pure arithmetic, no device code": [
        "memory",
        "overlap",
        "budget",
        "planner",
        "sharding",
        "architectures",
        "model_count",
        "engines",
    ],
    "base: units, safe files, usable cores": ["units", "files", "cores"],
}
