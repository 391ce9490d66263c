"""Figures for the book, drawn with matplotlib; each function returns its Figure."""

from __future__ import annotations

import numpy as np

from . import memory
from .units import format_count, parse_count

__all__ = ["state_vs_model_size"]


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
