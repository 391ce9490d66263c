"""The planner's report: the chosen plan, the runner-up, every plan considered, in prose and as
JSON."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .. import budget, memory
from ..units import format_bandwidth, format_count, format_duration, format_size
from .node import NodePlan
from .share import OptimizerShare
from .single import Candidate, Plan, offloaded_activations
from .workload import Hardware, Workload

__all__ = ["PlanReport"]


@dataclass(frozen=True)
class PlanReport:
    """The chosen plan, the runner-up, every plan considered, and what to say about them (a
    read-only record)."""

    work: Workload
    hardware: Hardware
    plans: tuple[Plan | NodePlan, ...]
    chosen: Plan | NodePlan | None
    runner_up: Plan | NodePlan | None
    ranking: tuple[Candidate, ...]
    warnings: tuple[str, ...] = ()
    duplex: str = "full"
    recipe: str = memory.DEFAULT_RECIPE
    share: OptimizerShare | None = None  # for a plan that offloads the optimizer: how much, where

    def __post_init__(self):
        for name in ("plans", "ranking", "warnings"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def _activation_line(self) -> str:
        c = self.chosen
        element = int(memory.get_recipe(self.recipe).weight_bytes)
        if getattr(c, "activations_offloaded", False):
            each_way, on_gpu = offloaded_activations(self.work, element)
            return (
                f"  activations: every layer's offloaded, {format_size(each_way)} down in forward "
                f"and up in backward; {format_size(on_gpu)} on the GPU at the peak (two layers "
                f"in flight, logits and loss); offloadlab.offload_activations runs it"
            )
        work = replace(self.work, context=getattr(c, "context", 1))
        kept = work.activations(c.checkpointed if c else 0, element)
        attention = (
            "SDPA (no seq × seq scores kept)"
            if self.work.attention == "sdpa"
            else "eager (the seq × seq scores kept)"
        )
        return (
            f"  activations {format_size(kept.total)} at their peak: layers "
            f"{format_size(kept.layers)}, logits and loss {format_size(kept.logits)}"
            + (f", a recomputed layer {format_size(kept.rebuilt)}" if kept.rebuilt else "")
            + f"; attention {attention}, {element}-byte activations"
        )

    def explain(self) -> str:
        if self.duplex in ("full", "half"):
            sharing = f"{self.duplex} duplex"
        else:
            both, _ = budget.both_directions_rate(self.hardware.link, self.duplex)
            sharing = f"{format_bandwidth(both)} each way while both run (measured)"
        lines = [
            f"model: {format_count(self.work.params)} parameters ({self.recipe}), batch "
            f"{self.work.batch} × seq {self.work.seq}; GPU {format_size(self.hardware.gpu_memory)} "
            f"({format_size(self.hardware.gpu_memory, binary=True)}); link "
            f"{format_bandwidth(self.hardware.link)} per direction, {sharing}"
        ]
        if self.work.shape_assumed:
            lines.append(
                f"assumed: a GPT-like shape of {self.work.layers} layers, hidden "
                f"{self.work.hidden}, {self.work.heads} heads, vocabulary {self.work.vocab:,} "
                f"(pass --layers/--hidden/--heads, or --model)"
            )
        lines += [f"assumed: {a}" for a in self.hardware.assumptions]
        lines.append("candidates in the natural order (bytes freed; traffic added each step):")
        lines += [
            f"  {c.name:<22} frees {format_size(c.frees_bytes):>9}, adds "
            f"{format_size(c.traffic_bytes):>9}/step — {c.note}"
            for c in self.ranking
        ]
        if self.chosen is None:
            lines.append("plan: nothing fits")
        else:
            lines += self._chosen_lines()
        lines += [f"note: {w}" for w in self.warnings]
        return "\n".join(lines)

    def _chosen_lines(self) -> list[str]:
        c = self.chosen
        lines = [
            f"plan: {c.name}",
            f"  GPU {format_size(c.gpu_bytes)} of {format_size(c.gpu_usable)} usable, "
            f"host {format_size(c.host_bytes)}, traffic {format_size(c.h2d_bytes)} up and "
            f"{format_size(c.d2h_bytes)} down per step",
            self._activation_line(),
        ]
        nvme_s = getattr(c, "t_nvme_passes", 0.0) + getattr(c, "t_nvme_after", 0.0)
        nvme = f", NVMe {format_duration(nvme_s)}" if nvme_s else ""
        lines.append(
            f"  step ≈ {format_duration(c.step)}: compute {format_duration(c.t_compute)}, then the "
            f"GPU waits {format_duration(c.waiting)} (link {format_duration(c.t_transfer)}, "
            f"CPU update {format_duration(c.t_cpu)}{nvme}, overlapped where the order allows)"
        )
        if isinstance(c, NodePlan):
            n, net = c.layout.gpus, self.hardware.collective_rate
            where = f"{c.nodes} nodes' " if c.nodes > 1 else ""
            over = "the network between nodes" if c.nodes > 1 else "the interconnect"
            if n > 1:
                lines.append(
                    f"  each of the {where}{n} GPUs: collectives carry "
                    f"{format_size(c.layout.interconnect_bytes)} per step ((N−1)/N of each "
                    f"gathered or reduced tensor) over {over}, {format_bandwidth(net)}: "
                    f"{format_duration(c.t_interconnect + c.t_interconnect_after)}; host "
                    f"{format_size(c.host_bytes * c.node_gpus)} for each node"
                )
            if c.context > 1:
                ring = replace(self.work, context=c.context).context_bytes(
                    c.checkpointed, int(memory.get_recipe(self.recipe).weight_bytes)
                )
                lines.append(
                    f"  context parallel: each of {c.context} GPUs of a node computes "
                    f"{self.work.seq // c.context:,} tokens of each sequence, attending over all "
                    f"{self.work.seq:,}; their ring of keys and values carries {format_size(ring)} "
                    "a step over the interconnect, beside attention (counted with the collectives)"
                )
            if c.estimate is not None:
                lines.append(
                    f"  DeepSpeed's own estimate: GPU {format_size(c.estimate['gpu_bytes'])} of "
                    f"model state, host {format_size(c.estimate['host_bytes_per_node'])} for the "
                    f"node ({'; '.join(c.estimate['terms'])}); the plan is fitted against it"
                )
            if c.layout.nvme_bytes:
                lines.append(
                    f"  NVMe: {format_size(c.layout.nvme_bytes * c.node_gpus)} on each node's "
                    "drive, "
                    f"{format_duration(c.t_nvme_passes + c.t_nvme_after)} of reads and writes per "
                    "step"
                )
        if c.t_step_delayed is not None:
            lines.append(
                f"  with a delayed parameter update (weights one step old): step ≈ "
                f"{format_duration(c.t_step_delayed)}"
            )
        lines.append(f"  binding constraint: {c.binding}")
        if self.share is not None:
            lines += self.share.lines()
        if self.runner_up is not None:
            r = self.runner_up
            lines.append(
                f"runner-up: {r.name}: step ≈ {format_duration(r.step)} "
                f"({r.step / c.step:.2f}× the plan), GPU {format_size(r.gpu_bytes)}"
            )
        return lines

    def to_dict(self) -> dict:
        element = int(memory.get_recipe(self.recipe).weight_bytes)
        kept = self.work.activations(self.chosen.checkpointed if self.chosen else 0, element)
        chosen = self.chosen.to_dict() if self.chosen else None
        if chosen is not None:
            # what CPUOffloadAdam is given to run it (offload 'nothing': all of it on the GPU)
            offloads = self.chosen.offload not in ("nothing", "none")
            chosen["offload_fraction"] = (
                self.share.offload_fraction if self.share else float(offloads)
            )
            chosen["update_on"] = self.share.update_on if self.share else "cpu"
        return {
            "chosen": chosen,
            "runner_up": self.runner_up.to_dict() if self.runner_up else None,
            "plans": [p.to_dict() for p in self.plans],
            "ranking": [c.__dict__ for c in self.ranking],
            "activations": {
                "offloaded_to_host": bool(getattr(self.chosen, "activations_offloaded", False)),
                "attention": self.work.attention,
                "element_bytes": element,
                "peak_bytes": kept.total,
                "layers_bytes": kept.layers,
                "logits_bytes": kept.logits,
                "rebuilt_layer_bytes": kept.rebuilt,
            },
            "optimizer_share": self.share.to_dict() if self.share else None,
            "duplex": self.duplex,
            "recipe": self.recipe,
            "assumptions": self.hardware.assumptions,
            "warnings": list(self.warnings),
        }
