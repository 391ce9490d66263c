"""Figures for the book, drawn with matplotlib; each function returns its Figure."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import memory
from .units import format_count, parse_count

__all__ = ["state_vs_model_size", "ladder", "timeline"]


def state_vs_model_size(recipes=("mixed-adam", "bf16-adam", "adam-8bit"), params_range=(1e8, 1e12)):
    """Training state (GB) against parameter count (log–log), with common card sizes across it."""
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

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
    import matplotlib.pyplot as plt

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
