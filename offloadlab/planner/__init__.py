"""What to offload, and in what order: rank the candidates, choose the least offload that fits.

Given a model, a GPU, a host↔GPU link, host memory, a CPU-Adam throughput and a compute rate,
:func:`plan` builds every plan in the natural order — nothing, then optimizer states, then
gradients, then parameters, each with activations kept or recomputed — predicts each plan's
memory and step time, and picks the least offload that fits. On a node of several GPUs it weighs
sharding (ZeRO-1/2/3, FSDP2) against offloading, fitting each plan as its engine would. It says
which constraint binds, what the runner-up would cost, when offload is the wrong tool and when
nothing fits.

The package, one job per module:

- :mod:`.workload`: what is trained and on what (:class:`Workload`, :class:`Hardware`), and the
  activations a step keeps;
- :mod:`.single`: one GPU's plans, offloadlab's own offload engine, laid out layer by layer;
- :mod:`.node`: a node's plans, sharded and offloaded, fitted by DeepSpeed's and FSDP2's accounts;
- :mod:`.choose`: :func:`plan`, which picks among them and says why;
- :mod:`.report`: :class:`PlanReport`, the prose and the JSON.

Units: bytes, bytes/s, seconds, FLOP/s, parameters/s.
"""

from .choose import plan
from .node import NODE_CANDIDATES, NodePlan, node_plans, nvme_plans
from .report import PlanReport
from .single import (
    HIDDEN_FRACTION,
    MAX_SIMULATED_LAYERS,
    OFFLOAD_LEVELS,
    Candidate,
    Plan,
    candidates,
    schedule,
    single_gpu_plans,
)
from .workload import (
    ASSUMED_COMPUTE,
    ASSUMED_CPU_ADAM,
    ASSUMED_INTERCONNECT,
    ASSUMED_NETWORK,
    ASSUMED_NVME,
    ASSUMED_VOCAB,
    ATTENTIONS,
    BYTES_MOVED_PER_ADAM_PARAM,
    HOST_RESERVE_FRACTION,
    WORKSPACE_FRACTION,
    Activations,
    Hardware,
    Workload,
    typical_shape,
)

__all__ = [
    "Workload",
    "Hardware",
    "Activations",
    "Candidate",
    "Plan",
    "NodePlan",
    "PlanReport",
    "candidates",
    "plan",
    "schedule",
    "single_gpu_plans",
    "node_plans",
    "nvme_plans",
    "typical_shape",
    "ASSUMED_COMPUTE",
    "ASSUMED_CPU_ADAM",
    "ASSUMED_INTERCONNECT",
    "ASSUMED_NETWORK",
    "ASSUMED_NVME",
    "ASSUMED_VOCAB",
    "ATTENTIONS",
    "WORKSPACE_FRACTION",
    "HOST_RESERVE_FRACTION",
    "BYTES_MOVED_PER_ADAM_PARAM",
    "HIDDEN_FRACTION",
    "MAX_SIMULATED_LAYERS",
    "OFFLOAD_LEVELS",
    "NODE_CANDIDATES",
]
