"""offloadlab: train models larger than GPU memory by offloading state to CPU memory and NVMe.

The package behind the offloadlab textbook and lab kit. It is built in layers, listed in
:data:`LAYERS` from the top down: each module imports only modules of its own layer or of the
layers below it (``tests/test_layers.py`` holds every module to that), and the two lowest — pure
arithmetic and the base — import nothing outside the standard library when they are imported, so
they also run in a browser (the static site's calculators run them in Pyodide). A package (link,
nvme, offload, planner) belongs to its layer with all its modules. Importing offloadlab changes
nothing in torch.

The public API, imported on first use (``import offloadlab`` alone loads no torch)::

    import offloadlab as ol
    optimizer = ol.CPUOffloadAdam(model.parameters(), lr=1e-3)  # AdamW, its state on the CPU
    ol.StreamedModel(model, ol.open_link())  # the blocks' weights in host memory, streamed
    with ol.offload_activations():  # saved tensors to host memory, back ahead of backward
        loss = model(x)
"""

from types import MappingProxyType
import importlib

__version__ = "0.1.0"

# name: the module that defines it (loaded when the name is first used)
_PUBLIC = {
    "CPUOffloadAdam": "offloadlab.offload",
    "LossScaler": "offloadlab.offload",
    "StreamedModel": "offloadlab.streaming",
    "offload_activations": "offloadlab.activations",
    "Prefetcher": "offloadlab.prefetch",
    "FileTier": "offloadlab.nvme",
    "open_state": "offloadlab.nvme",
    "adam_from_file": "offloadlab.nvme",
    "Link": "offloadlab.link",
    "CudaLink": "offloadlab.link",
    "EmulatedLink": "offloadlab.link",
    "open_link": "offloadlab.link",
    "plan": "offloadlab.planner",
    "Workload": "offloadlab.planner",
    "Hardware": "offloadlab.planner",
    "state_bytes": "offloadlab.memory",
}
__all__ = ["__version__", "LAYERS", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # (once: later uses find it here)
        return value
    raise AttributeError(f"module 'offloadlab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


# layer (top first): its modules. "Reading the package" in the book shows this map with each
# module's job, computed from this very dict.
LAYERS = MappingProxyType(
    {
        "face: the command and the benchmarks": ["cli", "bench", "fsdp_offload", "__main__"],
        "mechanisms: offload, streaming, prefetch, NVMe": [
            "offload",
            "activations",
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
)
