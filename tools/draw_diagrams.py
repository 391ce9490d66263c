"""Draw the book's explanatory diagrams as SVG files under book/_static/diagrams/.

Run from the repository root: ``python tools/draw_diagrams.py``. The output is committed (the
site stays offline and the notebooks need no drawing code); the files are deterministic (fixed
hash salt, no date), so re-running changes nothing unless a drawing changed.

- ``offload-step.svg`` (chapter 6): one step of CPUOffloadAdam — gradients gathered into buckets
  on the GPU, down on the device→host engine, updated on the CPU, weights up on the host→device
  engine.
- ``double-buffer.svg`` (chapter 7): two device buffers taking turns, and the two events that
  order each refill.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "book" / "_static" / "diagrams"
COLOURS = {"gpu": "#dbe9f6", "host": "#e5f2dc", "engine": "#fbe7c6", "cpu": "#f6d6d6", "edge": "#444444"}


def _box(ax, x, y, w, h, text, colour, size=9, weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=colour, edgecolor=COLOURS["edge"], linewidth=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight, wrap=True)


def _arrow(ax, start, end, text="", offset=(0, 0.12), size=8, style="-|>", colour=None):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, linewidth=1.3,
                                 color=colour or COLOURS["edge"]))
    if text:
        ax.text((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1], text, ha="center",
                va="bottom", fontsize=size)


def offload_step():
    fig, ax = plt.subplots(figsize=(9, 5.2))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 6)
    ax.axis("off")
    # the GPU
    _box(ax, 0.2, 3.6, 3.6, 2.2, "", COLOURS["gpu"])
    ax.text(2.0, 5.55, "GPU", ha="center", fontsize=11, weight="bold")
    _box(ax, 0.4, 4.45, 3.2, 0.8, "backward: gradients, bucket by bucket\n(gathered into a flat buffer, then freed)",
         "white", size=8)
    _box(ax, 0.4, 3.75, 3.2, 0.55, "parameters (bf16): 2 B each", "white", size=8)
    # the host
    _box(ax, 6.2, 0.2, 3.6, 5.6, "", COLOURS["host"])
    ax.text(8.0, 5.55, "host memory (pinned)", ha="center", fontsize=11, weight="bold")
    _box(ax, 6.4, 4.45, 3.2, 0.8, "landing gradients (bf16)\n2 B per parameter", "white", size=8)
    _box(ax, 6.4, 2.3, 3.2, 1.6, "fp32 master weights, first and\nsecond moments: 12 B per parameter\n\n"
         "updated in place by the CPU\n(fused AdamW, one pass)", COLOURS["cpu"], size=8)
    _box(ax, 6.4, 0.45, 3.2, 0.8, "outgoing weights (bf16)\n2 B per parameter", "white", size=8)
    # the copy engines
    _box(ax, 4.15, 4.55, 1.7, 0.6, "copy engine\ndevice → host", COLOURS["engine"], size=8)
    _box(ax, 4.15, 0.55, 1.7, 0.6, "copy engine\nhost → device", COLOURS["engine"], size=8)
    _arrow(ax, (3.6, 4.85), (4.15, 4.85))
    _arrow(ax, (5.85, 4.85), (6.4, 4.85))
    ax.text(5.0, 4.25, "one copy per bucket\n(tens of MiB)", ha="center", va="top", fontsize=8)
    _arrow(ax, (8.0, 4.45), (8.0, 3.9), "", offset=(0, 0))
    _arrow(ax, (8.0, 2.3), (8.0, 1.25))
    _arrow(ax, (6.4, 0.85), (5.85, 0.85))
    _arrow(ax, (4.15, 0.85), (2.0, 0.85), "")
    _arrow(ax, (2.0, 0.85), (2.0, 3.75), "scattered into\nthe parameters", offset=(-0.95, -0.2))
    ax.text(5.0, 2.75, "both engines run at once:\nPCIe is full duplex", ha="center", fontsize=9, style="italic")
    ax.text(8.1, 4.1, "once landed", fontsize=7, va="center")
    ax.text(8.1, 1.75, "new weights, rounded", fontsize=7, va="center")
    ax.text(5.0, 5.35, "2 B/param down", ha="center", fontsize=8)
    ax.text(5.0, 0.25, "2 B/param up", ha="center", fontsize=8)
    fig.tight_layout()
    return fig


def double_buffer():
    fig, ax = plt.subplots(figsize=(9, 3.4))
    ax.set_xlim(-1.6, 10.2)
    ax.set_ylim(-0.4, 3.2)
    ax.axis("off")
    ax.text(-1.55, 2.25, "copy engine\n(host → device)", va="center", fontsize=8)
    ax.text(-1.55, 0.95, "compute stream", va="center", fontsize=8)
    slot_colours = {"A": "#cfe2f3", "B": "#fce5cd"}
    fetches = [(0.0, 1.0, "L0 → A", "A"), (1.0, 2.0, "L1 → B", "B"), (3.2, 4.2, "L2 → A", "A"),
               (5.4, 6.4, "L3 → B", "B")]
    computes = [(1.0, 3.2, "L0 in A", "A"), (3.2, 5.4, "L1 in B", "B"), (5.4, 7.6, "L2 in A", "A"),
                (7.6, 9.8, "L3 in B", "B")]
    for start, end, text, slot in fetches:
        _box(ax, start, 1.95, end - start - 0.05, 0.6, text, slot_colours[slot], size=8)
    for start, end, text, slot in computes:
        _box(ax, start, 0.65, end - start - 0.05, 0.6, text, slot_colours[slot], size=8)
    # copy event: compute waits for its layer's copy
    _arrow(ax, (0.95, 1.95), (1.1, 1.25), "", colour="#1f77b4")
    ax.text(0.1, 1.45, "waits for\nthe copy", fontsize=7, color="#1f77b4")
    # release marker: refill of A waits for L0's compute to finish with A
    _arrow(ax, (3.15, 1.25), (3.25, 1.95), "", colour="#d62728")
    ax.text(2.15, 1.45, "refill waits for\nthe release", fontsize=7, color="#d62728")
    ax.annotate("", xy=(9.9, 0.2), xytext=(0.0, 0.2), arrowprops={"arrowstyle": "-|>", "color": "#777777"})
    ax.text(9.9, -0.2, "time", ha="right", fontsize=8, color="#777777")
    ax.text(4.3, 2.95, "two device buffers, A and B: one is read by compute while the other fills",
            ha="center", fontsize=9)
    fig.tight_layout()
    return fig


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    plt.rcParams["svg.hashsalt"] = "offloadlab"
    plt.rcParams["svg.fonttype"] = "none"  # text stays text: searchable, and small
    for name, draw in (("offload-step", offload_step), ("double-buffer", double_buffer)):
        fig = draw()
        fig.savefig(OUT / f"{name}.svg", format="svg", metadata={"Date": None})
        plt.close(fig)
        print(f"wrote {OUT / f'{name}.svg'}")


if __name__ == "__main__":
    main()
