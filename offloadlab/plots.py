"""Figures for the book, drawn with matplotlib; each function returns its Figure."""

from __future__ import annotations

from collections.abc import Mapping

# Imported with the module, not at the first figure: a notebook imports this in its first cell, and an
# interrupt that lands in a half-done import of matplotlib leaves the kernel unable to draw again.
import matplotlib.pyplot as plt
import numpy as np

from . import memory, sharding
from .units import format_count, parse_count

__all__ = ["state_vs_model_size", "state_breakdown", "who_holds_what", "held_per_param", "ladder", "timeline"]


def state_vs_model_size(recipes=("mixed-adam", "bf16-adam", "adam-8bit"), params_range=(1e8, 1e12)):
    """Training state (GB) against parameter count (log–log), with common card sizes across it."""
    low, high = (parse_count(p, "params_range") for p in params_range)
    if low >= high:
        raise ValueError(f"params_range: expected (low, high) with low < high; got {params_range!r}")
    params = np.logspace(np.log10(low), np.log10(high), 200)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in recipes:
        per_param = memory.get_recipe(name).total
        ax.plot(params, params * per_param / 1e9, label=f"{name} ({per_param:g} B/param)")
    for label, size in memory.GPU_SIZES.items():
        ax.axhline(size / 1e9, color="grey", lw=0.8, ls="--")
        ax.text(low * 1.1, size / 1e9 * 1.06, f"{label} card", color="grey", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("persistent training state (GB)")
    ax.xaxis.set_major_formatter(lambda x, _pos: format_count(x))
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Model state against GPU memory")
    fig.tight_layout()
    return fig


_SOURCE_STYLE = {"measured": ("o", "tab:blue"), "emulated": ("s", "tab:orange"), "nominal": ("D", "tab:grey")}


def ladder(mine: dict, reference: dict | None = None, title: str = "The memory-tier ladder"):
    """Capacity against bandwidth (log–log) for each tier, with the host links drawn across.

    ``mine`` and ``reference`` are ladders from :mod:`offloadlab.ladder`; every point is
    marked by its source (measured, emulated, nominal), and rows without a figure are left out.
    """
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    labelled = set()
    for which, data in (("this machine", mine), ("reference", reference)):
        if not data:
            continue
        for tier in data["tiers"]:
            capacity, rate = tier.get("capacity_bytes"), tier.get("bandwidth_bytes_per_s")
            if not capacity or not rate:
                continue
            marker, colour = _SOURCE_STYLE.get(tier["source"], ("x", "black"))
            key = f"{which}, {tier['source']}"
            ax.scatter(capacity / 1e9, rate / 1e9, marker=marker, color=colour, s=60,
                       facecolors="none" if which == "reference" else colour,
                       label=None if key in labelled else key)
            labelled.add(key)
            ax.annotate(tier["name"], (capacity / 1e9, rate / 1e9), textcoords="offset points",
                        xytext=(6, 4), fontsize=8)
    # The links as horizontal lines: the bandwidth cliff is the gap between HBM and these.
    lines = [(link["bandwidth_bytes_per_s"], f"{link['name']} ({link['source']})", which == "reference")
             for which, data in (("this machine", mine), ("reference", reference)) if data
             for link in data["links"]
             if link.get("bandwidth_bytes_per_s") and "disk" not in link["name"] and "GPU → host" not in link["name"]]
    for rate, _, is_reference in lines:
        ax.axhline(rate / 1e9, color="grey" if is_reference else "tab:orange", ls=":" if is_reference else "--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.margins(x=0.3, y=0.15)
    ax.set_xlabel("capacity (GB)")
    ax.set_ylabel("bandwidth (GB/s)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower left")
    _label_lines_at_the_right(fig, ax, [(rate / 1e9, text) for rate, text, _ in lines])
    fig.tight_layout()
    return fig


def _label_lines_at_the_right(fig, ax, lines, fontsize: float = 7.0):
    """Name horizontal lines (y, text) beside the axes, right of the plot, moved apart so no two overlap.

    Links of similar bandwidth (PCIe gen 4 and 5, InfiniBand) lie close together on a log scale;
    their names go in the margin, each at least one line of text above the one below it, with a
    thin leader to its line.
    """
    if not lines:
        return
    ax.autoscale_view()
    low, high = np.log10(ax.get_ylim())
    fig.canvas.draw()
    decades_per_pixel = (high - low) / max(ax.get_window_extent().height, 1.0)
    gap = 1.35 * fontsize * fig.dpi / 72 * decades_per_pixel  # one line of text, in decades
    placed, previous = [], -np.inf
    for y, text in sorted(lines):
        at = max(np.log10(y), previous + gap)
        placed.append((y, 10 ** at, text))
        previous = at
    overflow = previous - high  # labels pushed above the top come back down, keeping their spacing
    if overflow > 0:
        placed = [(y, 10 ** (np.log10(at) - overflow), text) for y, at, text in placed]
    transform = ax.get_yaxis_transform()
    for y, at, text in placed:
        ax.annotate(text, xy=(1.0, y), xycoords=transform, xytext=(1.03, at), textcoords=transform,
                    va="center", ha="left", fontsize=fontsize, color="dimgrey", annotation_clip=False,
                    arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "grey", "shrinkA": 0, "shrinkB": 0})


_LANE_COLOURS = {"compute": "tab:blue", "H2D": "tab:orange", "D2H": "tab:green", "CPU": "tab:purple"}
_MIN_BAR_PIXELS = 2.0  # an interval shorter than this still shows as a sliver, not as an empty lane


def lane_colour(name: str) -> str:
    """The colour of a lane: by its stream (compute, H2D, D2H, CPU), matched at the start of the name."""
    for stream, colour in _LANE_COLOURS.items():
        if name.split(",")[0].split(" (")[0].strip() == stream:
            return colour
    return "tab:grey"


def _variants(lanes) -> dict:
    """``lanes`` as {variant: {lane: intervals}}; a single variant's lanes come back under the name ""."""
    if not isinstance(lanes, Mapping) or not lanes:
        raise ValueError(f"lanes: expected a non-empty mapping of lane names to (start, end, label) intervals, "
                         f"or of variant names to such mappings; got {lanes!r}")
    nested = [isinstance(value, Mapping) for value in lanes.values()]
    if all(nested):
        variants = {str(name): dict(value) for name, value in lanes.items()}
    elif not any(nested):
        variants = {"": dict(lanes)}
    else:
        raise ValueError("lanes: expected either lanes or variants of lanes, not a mix of both")
    for variant, variant_lanes in variants.items():
        where = f" of {variant!r}" if variant else ""
        if not variant_lanes:
            raise ValueError(f"lanes: variant {variant!r} has no lanes")
        for name, intervals in variant_lanes.items():
            intervals = variant_lanes[name] = list(intervals)
            for start, end, label in intervals:
                if end < start:
                    raise ValueError(f"lanes: interval {label!r} in {name!r}{where} ends before it starts")
    return variants


def timeline(lanes: Mapping, title: str = "Timeline", source: str = "measured"):
    """Recorded or predicted intervals, one horizontal lane per stream, one time axis per variant.

    ``lanes`` is either one variant, a mapping of lane name (compute, H2D, D2H, CPU; a suffix such
    as ``"H2D, one buffer"`` keeps the colour) to a list of ``(start, end, label)`` in seconds, or
    several: a mapping of variant name to such a mapping. Variants are drawn as small multiples,
    one axis each, each starting at its own first event (time 0), all on the same scale, so the
    lengths of their steps compare by eye. Times are shown in ms. An interval too short to see at
    that scale is drawn 2 pixels wide, so a lane with work in it never looks empty; intervals that
follow each other without a gap are parted by a thin white edge. The title says
    whether the times were measured, emulated or modelled (``source``).
    """
    variants = _variants(lanes)
    spans = {}
    for variant, variant_lanes in variants.items():
        intervals = [iv for lane in variant_lanes.values() for iv in lane]
        begin = min((start for start, _, _ in intervals), default=0.0)
        end = max((end for _, end, _ in intervals), default=begin)
        spans[variant] = (begin, end)
    longest_ms = max((end - begin) * 1e3 for begin, end in spans.values()) or 1.0

    heights = [0.35 + 0.32 * len(variant_lanes) for variant_lanes in variants.values()]
    fig, axes = plt.subplots(len(variants), 1, figsize=(8, 0.55 + sum(heights)), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    fig.canvas.draw()  # the axes' pixel widths, for the shortest visible bar
    for ax, (variant, variant_lanes) in zip(axes[:, 0], variants.items()):
        zero = spans[variant][0]
        min_width_ms = _MIN_BAR_PIXELS * longest_ms / max(ax.get_window_extent().width, 1.0)
        names = list(variant_lanes)
        for row, name in enumerate(names):
            colour = lane_colour(name)
            for start, end, label in variant_lanes[name]:
                left, width = (start - zero) * 1e3, (end - start) * 1e3
                # A thin white edge parts back-to-back intervals; a bar at the minimum width keeps its fill.
                edge = 0.5 if width > 3 * min_width_ms else 0
                ax.barh(row, max(width, min_width_ms), left=left, height=0.7, color=colour, edgecolor="white",
                        linewidth=edge)
                if label and width > 0.08 * longest_ms:
                    ax.text(left + width / 2, row, label, ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(names)), [name.split(",")[0].split(" (")[0] if variant else name for name in names],
                      fontsize=8)
        ax.set_ylim(len(names) - 0.5, -0.5)
        if variant:
            step_ms = (spans[variant][1] - zero) * 1e3
            ax.set_title(f"{variant}: {step_ms:.3g} ms", loc="left", fontsize=9)
        ax.grid(axis="x", color="0.9", lw=0.6)
        ax.set_axisbelow(True)
    axes[0, 0].set_xlim(0, longest_ms * 1.02)
    axes[-1, 0].set_xlabel("time from the variant's first event (ms)" if len(variants) > 1 else "time (ms)")
    fig.suptitle(f"{title} ({source})", fontsize=11)
    fig.tight_layout()
    return fig


# One colour per kind of state: the two the passes use in blues, the optimizer's own in oranges.
_KIND_COLOURS = {"weights": "#2166ac", "gradients": "#67a9cf", "master_weights": "#b35806",
                 "first_moment": "#f1a340", "second_moment": "#fdb863", "quantization_scales": "#7f3b08",
                 "fp32 gradient shard": "#4d9221"}
_KIND_LABELS = {"weights": "weights", "gradients": "gradients", "master_weights": "fp32 master weights",
                "first_moment": "first moment", "second_moment": "second moment",
                "quantization_scales": "8-bit scales", "fp32 gradient shard": "fp32 gradient shard"}


def state_breakdown(recipes=("mixed-adam", "mixed-adam-fp32-grads", "fp32-adam", "bf16-adam", "adam-8bit")):
    """Bytes per parameter of each recipe as one stacked bar, segment by kind of state.

    The kinds only the optimizer's update touches are drawn in oranges, the weights and gradients
    the forward and backward passes use in blues; each segment wide enough to hold it is labelled
    with its bytes.
    """
    names = list(recipes)
    if not names:
        raise ValueError("recipes: expected one or more recipe names; got none")
    chosen = [memory.get_recipe(name) for name in names]
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.55 * len(chosen)))
    seen = set()
    for row, recipe in enumerate(chosen):
        left = 0.0
        for kind in memory.KINDS:
            size = recipe.bytes_per_param.get(kind, 0)
            if not size:
                continue
            label = _KIND_LABELS[kind]
            ax.barh(row, size, left=left, height=0.62, color=_KIND_COLOURS[kind], edgecolor="white", linewidth=1,
                    label=None if label in seen else label)
            seen.add(label)
            if size >= 1:
                ax.text(left + size / 2, row, f"{size:g}", ha="center", va="center", fontsize=8, color="white")
            left += size
        ax.text(left + 0.2, row, f"{recipe.total:.3g} B", va="center", fontsize=8)
    ax.set_yticks(range(len(chosen)), names, fontsize=8)
    ax.set_ylim(len(chosen) - 0.5, -0.5)
    ax.set_xlim(0, max(r.total for r in chosen) * 1.12)
    ax.set_xlabel("bytes of persistent state per parameter")
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, ncol=4, loc="lower center", frameon=False)
    ax.set_title("Where the bytes per parameter go", fontsize=10)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    return fig


def held_per_param(strategy: str, gpus: int, recipe: str = memory.DEFAULT_RECIPE) -> dict:
    """Bytes of model state per parameter one GPU holds under ``strategy`` (no offload), by kind.

    Each value is (bytes, sharded): a sharded kind is the GPU's 1/``gpus`` share. Gathered
    weights (ZeRO-3, FSDP2's working set) are left out; the totals are
    :func:`offloadlab.sharding.layout`'s ``gpu_bytes`` per parameter for a model without them.
    """
    if strategy not in sharding.STRATEGIES:
        raise ValueError(f"strategy: expected one of {', '.join(sharding.STRATEGIES)}; got {strategy!r}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus: expected a positive integer; got {gpus!r}")
    kinds = memory.get_recipe(recipe).bytes_per_param
    w = kinds["weights"]
    optimizer = {k: kinds[k] for k in ("master_weights", "first_moment", "second_moment") if k in kinds}
    share, fp32 = 1 / gpus, sharding.DEEPSPEED_FP32_GRADIENT
    if strategy == "fsdp2":  # the sharded fp32 parameters are the master copy; gradients take their dtype
        master = kinds.get("master_weights", 0) or w
        moments = {k: v * share for k, v in optimizer.items() if k != "master_weights"}
        return {"master_weights": (master * share, True), "gradients": (master * share, True),
                **{k: (v, True) for k, v in moments.items()}}
    whole = {"ddp": ("weights", "gradients"), "zero1": ("weights", "gradients"), "zero2": ("weights",),
             "zero3": ()}[strategy]
    split = {"ddp": (), "zero1": (), "zero2": ("gradients",), "zero3": ("weights",)}[strategy]
    held = {kind: (kinds[kind], False) for kind in whole}
    held.update({kind: (kinds[kind] * share, True) for kind in split})
    if strategy != "ddp":  # DeepSpeed's fp32 copy of the rank's gradient partition, read by its optimizer
        held["fp32 gradient shard"] = (fp32 * share, True)
    for kind, size in optimizer.items():
        held[kind] = (size, False) if strategy == "ddp" else (size * share, True)
    return held


def who_holds_what(gpus: int = 4, strategies=("ddp", "zero1", "zero2", "zero3", "fsdp2"),
                   recipe: str = memory.DEFAULT_RECIPE):
    """For each strategy, the bytes per parameter each of ``gpus`` GPUs holds, stacked by kind.

    A kind every GPU holds whole is drawn solid; a sharded kind is hatched and labelled with the
    shard the GPU owns (k/N), so the picture shows who holds what, not only how much.
    """
    names = list(strategies)
    if not names:
        raise ValueError("strategies: expected one or more of " + ", ".join(sharding.STRATEGIES) + "; got none")
    labels = {"ddp": "data parallel", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp2": "FSDP2"}
    fig, axes = plt.subplots(1, len(names), figsize=(1.55 * len(names) + 1.6, 3.6), sharey=True, squeeze=False)
    seen = set()
    for ax, strategy in zip(axes[0], names):
        held = held_per_param(strategy, gpus, recipe)
        for gpu in range(gpus):
            bottom = 0.0
            for kind, (size, sharded) in held.items():
                fp32 = strategy == "fsdp2" and kind == "gradients"  # FSDP2's gradients take the fp32 shard's dtype
                label = "fp32 gradients" if fp32 else f"16-bit {kind}" if kind in ("weights", "gradients") \
                    else _KIND_LABELS[kind]
                colour = _KIND_COLOURS["fp32 gradient shard" if fp32 else kind]
                ax.bar(gpu, size, bottom=bottom, width=0.78, color=colour, edgecolor="white", linewidth=0.6,
                       hatch="///" if sharded else None, label=None if label in seen else label)
                seen.add(label)
                bottom += size
            ax.text(gpu, bottom + 0.25, f"{bottom:.3g}", ha="center", fontsize=7)
        ax.set_title(labels[strategy], fontsize=9)
        ax.set_xticks(range(gpus), [str(i) for i in range(gpus)], fontsize=7)
        ax.tick_params(axis="x", length=0)
        ax.set_xlabel("GPU (its shard)", fontsize=7)
    axes[0, 0].set_ylabel("bytes per parameter on each GPU")
    handles, texts = [], []
    for ax in axes[0]:
        h, t = ax.get_legend_handles_labels()
        handles, texts = handles + h, texts + t
    fig.legend(handles, texts, fontsize=7, loc="center right", frameon=False)
    fig.suptitle(f"Who holds what on {gpus} GPUs (hatched: each GPU's own 1/{gpus} shard)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    return fig
