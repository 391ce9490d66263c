"""Figures for the book, drawn with matplotlib; each function returns its Figure."""

from __future__ import annotations

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

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
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
    for i, (rate, text, is_reference) in enumerate(sorted(lines)):
        ax.axhline(rate / 1e9, color="grey" if is_reference else "tab:orange", ls=":" if is_reference else "--", lw=0.8)
        ax.text(0.99, rate / 1e9, text, transform=ax.get_yaxis_transform(), ha="right",
                va="bottom" if i % 2 else "top", fontsize=7, color="dimgrey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.margins(x=0.3, y=0.15)
    ax.set_xlabel("capacity (GB)")
    ax.set_ylabel("bandwidth (GB/s)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


_LANE_COLOURS = {"compute": "tab:blue", "H2D": "tab:orange", "D2H": "tab:green", "CPU": "tab:purple"}


def timeline(lanes: dict, title: str = "Timeline", source: str = "measured"):
    """One horizontal lane per stream (compute, H2D, D2H, CPU) with a bar per recorded interval.

    ``lanes`` maps a lane name to a list of (start, end, label) in seconds; the figure is in ms
    and its title says whether the times were measured or emulated.
    """
    import matplotlib.pyplot as plt

    if not lanes:
        raise ValueError("lanes: expected at least one lane of (start, end, label) intervals")
    names = list(lanes)
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.55 * len(names)))
    for row, name in enumerate(names):
        for start, end, label in lanes[name]:
            if end < start:
                raise ValueError(f"lanes: interval {label!r} in {name!r} ends before it starts")
            ax.barh(row, (end - start) * 1e3, left=start * 1e3, height=0.6,
                    color=_LANE_COLOURS.get(name, "tab:grey"), edgecolor="white")
            if label and (end - start) > 0:
                ax.text((start + end) / 2 * 1e3, row, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{title} ({source})")
    fig.tight_layout()
    return fig
