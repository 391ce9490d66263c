"""Draw the book's explanatory diagrams as SVG files under book/figures/.

The diagrams are committed so the site builds offline without running this script; run it
after changing one (`python tools/diagrams.py`) and commit the SVG it writes. Text stays text
in the SVG (searchable, and read by screen readers beside the figure's alt text), and the
output is byte-stable: no date, fixed element ids.

- ``pcie_topology.svg`` (chapter 4): host and GPU joined by PCIe, a copy engine per direction.
- ``offload_step.svg`` (chapter 6): one step of CPUOffloadAdam — gradients gathered into buckets
  on the GPU, down on the device→host engine, updated on the CPU, weights up on the host→device
  engine.
- ``double_buffer.svg`` (chapter 7): two device buffers taking turns, and the two events that
  order each refill.
- ``nvme_path.svg`` (chapter 8): optimizer state from the drives through pinned host memory to
  the CPU update and back, a chunk at a time; the GPU's 4 bytes per parameter beside it.
- ``two_slot_commit.svg`` (chapter 8): one file, two headers, two slots, and the four steps of a
  commit.

Usage: python tools/diagrams.py [--out FOLDER]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from offloadlab.budget import PCIE_X16  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "book" / "figures"
GREY, HOST, GPU, LINK = "#4d4d4d", "#e8f0fa", "#eaf5e6", "#b35806"


def _box(ax, x, y, w, h, title, lines=(), face="white", size=9):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=face, edgecolor=GREY, linewidth=1))
    ax.text(x + w / 2, y + h - 0.12, title, ha="center", va="top", fontsize=size, weight="bold", color="black")
    for i, line in enumerate(lines):
        ax.text(x + w / 2, y + h - 0.42 - 0.24 * i, line, ha="center", va="top", fontsize=size - 1.5, color=GREY)


def _arrow(ax, start, end, colour=GREY, width=1.2, both=False):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="<|-|>" if both else "-|>", mutation_scale=11,
                                 color=colour, linewidth=width, shrinkA=0, shrinkB=0))


def pcie_topology(path: Path) -> Path:
    """Host and GPU joined by PCIe: one copy engine per direction, host DRAM shared by all."""
    nominal, achievable = PCIE_X16["PCIe 4.0 ×16"]
    fig, ax = plt.subplots(figsize=(10.4, 4.6))
    ax.set_xlim(0, 10.4)
    ax.set_ylim(0, 4.6)
    ax.axis("off")

    # The host: CPU cores and DRAM behind one memory bus, reached by the GPU through the root complex.
    _box(ax, 0.15, 0.55, 4.0, 3.9, "host", face=HOST, size=10)
    _box(ax, 0.35, 2.75, 1.75, 1.25, "CPU cores",
         ["the Adam update:", "reads 12 B + gradient,", "writes 12 B + weights"])
    _box(ax, 0.35, 0.75, 3.6, 1.55, "host DRAM (pinned buffers)",
         ["fp32 master weights and moments", "gradients as they land", "16-bit weights on their way up"])
    _box(ax, 2.6, 2.75, 1.35, 1.25, "PCIe root", ["complex"])
    _arrow(ax, (1.2, 2.73), (1.2, 2.32), both=True)
    ax.text(1.3, 2.52, "memory bus, shared", fontsize=7.5, color=GREY, va="center")
    _arrow(ax, (3.27, 2.32), (3.27, 2.73), both=True)
    ax.text(3.35, 2.52, "DMA", fontsize=7.5, color=GREY, va="center")

    # The link: 16 lanes, each with a wire pair per direction, so both directions run at once.
    rate = f"{achievable / 1e9:.0f} GB/s ({nominal / 1e9:.1f} nominal)"
    _arrow(ax, (3.97, 3.7), (6.4, 3.7), colour=LINK, width=2.2)
    ax.text(5.07, 3.82, "host → GPU", ha="center", fontsize=8, color=LINK, weight="bold")
    ax.text(5.07, 3.48, rate, ha="center", fontsize=7, color=LINK)
    _arrow(ax, (6.4, 2.9), (3.97, 2.9), colour=LINK, width=2.2)
    ax.text(5.07, 3.02, "GPU → host", ha="center", fontsize=8, color=LINK, weight="bold")
    ax.text(5.07, 2.68, rate, ha="center", fontsize=7, color=LINK)
    ax.text(5.07, 4.38, "PCIe 4.0 ×16", ha="center", fontsize=9, weight="bold", color=LINK)
    ax.text(5.07, 4.12, "16 lanes, each full duplex", ha="center", fontsize=7, color=LINK)

    # The GPU: one copy engine per direction, beside the SMs, all writing and reading HBM.
    _box(ax, 6.2, 0.55, 4.05, 3.9, "GPU", face=GPU, size=10)
    _box(ax, 6.4, 3.35, 1.7, 0.7, "copy engine", ["host → GPU"], size=8)
    _box(ax, 6.4, 2.55, 1.7, 0.7, "copy engine", ["GPU → host"], size=8)
    _box(ax, 8.3, 2.55, 1.75, 1.5, "SMs", ["forward and", "backward"])
    _box(ax, 6.4, 0.75, 3.65, 1.4, "HBM", ["16-bit weights, activations,", "gradients until they leave"])
    _arrow(ax, (7.25, 2.53), (7.25, 2.17), both=True)
    _arrow(ax, (9.17, 2.53), (9.17, 2.17), both=True)

    ax.text(5.2, 0.22, "Every lane has a wire pair each way, and the GPU a copy engine each way: gradients going down and weights "
            "coming up move at once (full duplex),\nwhen they are issued on two streams. Every byte they move, and "
            "every byte the CPU update touches, passes through host DRAM.",
            ha="center", va="center", fontsize=7.5, color="black")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "offloadlab"}):
        fig.savefig(path, format="svg", metadata={"Date": None, "Creator": None}, bbox_inches="tight")
    plt.close(fig)
    return path


# The data-flow diagrams' palette and boxes (text centred in the box, arrows optionally labelled).
COLOURS = {"gpu": "#dbe9f6", "host": "#e5f2dc", "engine": "#fbe7c6", "cpu": "#f6d6d6", "edge": "#444444"}


def _flow_box(ax, x, y, w, h, text, colour, size=9, weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=colour, edgecolor=COLOURS["edge"], linewidth=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight, wrap=True)


def _flow_arrow(ax, start, end, text="", offset=(0, 0.12), size=8, style="-|>", colour=None):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, linewidth=1.3,
                                 color=colour or COLOURS["edge"]))
    if text:
        ax.text((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1], text, ha="center",
                va="bottom", fontsize=size)


def offload_step(path: Path) -> Path:
    """One CPUOffloadAdam step: buckets down on one engine, the CPU update, weights up on the other."""
    fig, ax = plt.subplots(figsize=(9, 5.2))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 6)
    ax.axis("off")
    # the GPU
    _flow_box(ax, 0.2, 3.6, 3.6, 2.2, "", COLOURS["gpu"])
    ax.text(2.0, 5.55, "GPU", ha="center", fontsize=11, weight="bold")
    _flow_box(ax, 0.4, 4.45, 3.2, 0.8, "backward: gradients, bucket by bucket\n(gathered into a flat buffer, then freed)",
         "white", size=8)
    _flow_box(ax, 0.4, 3.75, 3.2, 0.55, "parameters (bf16): 2 B each", "white", size=8)
    # the host
    _flow_box(ax, 6.2, 0.2, 3.6, 5.6, "", COLOURS["host"])
    ax.text(8.0, 5.55, "host memory (pinned)", ha="center", fontsize=11, weight="bold")
    _flow_box(ax, 6.4, 4.45, 3.2, 0.8, "landing gradients (bf16)\n2 B per parameter", "white", size=8)
    _flow_box(ax, 6.4, 2.3, 3.2, 1.6, "fp32 master weights, first and\nsecond moments: 12 B per parameter\n\n"
         "updated in place by the CPU\n(fused AdamW, one pass)", COLOURS["cpu"], size=8)
    _flow_box(ax, 6.4, 0.45, 3.2, 0.8, "outgoing weights (bf16)\n2 B per parameter", "white", size=8)
    # the copy engines
    _flow_box(ax, 4.15, 4.55, 1.7, 0.6, "copy engine\ndevice → host", COLOURS["engine"], size=8)
    _flow_box(ax, 4.15, 0.55, 1.7, 0.6, "copy engine\nhost → device", COLOURS["engine"], size=8)
    _flow_arrow(ax, (3.6, 4.85), (4.15, 4.85))
    _flow_arrow(ax, (5.85, 4.85), (6.4, 4.85))
    ax.text(5.0, 4.25, "one copy per bucket\n(tens of MiB)", ha="center", va="top", fontsize=8)
    _flow_arrow(ax, (8.0, 4.45), (8.0, 3.9), "", offset=(0, 0))
    _flow_arrow(ax, (8.0, 2.3), (8.0, 1.25))
    _flow_arrow(ax, (6.4, 0.85), (5.85, 0.85))
    _flow_arrow(ax, (4.15, 0.85), (2.0, 0.85), "")
    _flow_arrow(ax, (2.0, 0.85), (2.0, 3.75), "scattered into\nthe parameters", offset=(-0.95, -0.2))
    ax.text(5.0, 2.75, "both engines run at once\n(full duplex: each way\nkeeps most, not all,\nof its one-way rate)",
            ha="center", fontsize=9, style="italic")
    ax.text(8.1, 4.1, "once landed", fontsize=7, va="center")
    ax.text(8.1, 1.75, "new weights, rounded", fontsize=7, va="center")
    ax.text(5.0, 5.35, "2 B/param down", ha="center", fontsize=8)
    ax.text(5.0, 0.25, "2 B/param up", ha="center", fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def double_buffer(path: Path) -> Path:
    """Two device buffers taking turns, and the two events that order each refill."""
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
        _flow_box(ax, start, 1.95, end - start - 0.05, 0.6, text, slot_colours[slot], size=8)
    for start, end, text, slot in computes:
        _flow_box(ax, start, 0.65, end - start - 0.05, 0.6, text, slot_colours[slot], size=8)
    # copy event: compute waits for its layer's copy
    _flow_arrow(ax, (0.95, 1.95), (1.1, 1.25), "", colour="#1f77b4")
    ax.text(0.1, 1.45, "waits for\nthe copy", fontsize=7, color="#1f77b4")
    # release marker: refill of A waits for L0's compute to finish with A
    _flow_arrow(ax, (3.15, 1.25), (3.25, 1.95), "", colour="#d62728")
    ax.text(2.15, 1.45, "refill waits for\nthe release", fontsize=7, color="#d62728")
    ax.annotate("", xy=(9.9, 0.2), xytext=(0.0, 0.2), arrowprops={"arrowstyle": "-|>", "color": "#777777"})
    ax.text(9.9, -0.2, "time", ha="right", fontsize=8, color="#777777")
    ax.text(4.3, 2.95, "two device buffers, A and B: one is read by compute while the other fills",
            ha="center", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


# Chapter 8's diagrams. They are drawn at 6.6 inches or less with text of 9 points or more, so that
# at the site's column width (672 CSS px) no text is under 11 px; captions stay in the chapter.
FIG8_TEXT = 9


def nvme_path(path: Path) -> Path:
    """Optimizer state on NVMe: read into pinned host memory, updated by the CPU, written back."""
    size = FIG8_TEXT
    fig, ax = plt.subplots(figsize=(6.6, 3.6))
    ax.set_xlim(0, 6.6)
    ax.set_ylim(0.25, 3.85)
    ax.axis("off")
    _flow_box(ax, 0.05, 0.55, 1.55, 2.7, "", COLOURS["engine"])
    ax.text(0.82, 3.0, "NVMe drives", ha="center", fontsize=size + 1, weight="bold")
    for i in range(4):
        _flow_box(ax, 0.2, 2.35 - 0.5 * i, 1.25, 0.38, f"drive {i}", "white", size=size)
    ax.text(0.82, 0.65, "striped", ha="center", fontsize=size)
    _flow_box(ax, 2.15, 0.3, 2.45, 3.2, "", COLOURS["host"])
    ax.text(3.37, 3.22, "host memory (pinned)", ha="center", fontsize=size + 1, weight="bold")
    _flow_box(ax, 2.3, 2.35, 2.15, 0.6, "chunk i + 1: reads\nlanding", "white", size=size)
    _flow_box(ax, 2.3, 1.45, 2.15, 0.7, "chunk i: CPU AdamW\non master, m, v (fp32)", COLOURS["cpu"],
              size=size)
    _flow_box(ax, 2.3, 0.5, 2.15, 0.6, "chunk i − 1: writes\nleaving", "white", size=size)
    _flow_arrow(ax, (1.6, 2.65), (2.3, 2.65), "12 B read", size=size)
    _flow_arrow(ax, (2.3, 0.8), (1.6, 0.8), "12 B written", size=size)
    _flow_arrow(ax, (3.37, 2.35), (3.37, 2.15))
    _flow_arrow(ax, (3.37, 1.45), (3.37, 1.1))
    _flow_box(ax, 5.1, 1.0, 1.45, 1.9, "", COLOURS["gpu"])
    ax.text(5.82, 2.6, "GPU", ha="center", fontsize=size + 1, weight="bold")
    ax.text(5.82, 1.95, "bf16 weights,\nforward and\nbackward", ha="center", va="center", fontsize=size)
    _flow_arrow(ax, (5.1, 1.55), (4.45, 1.55), "2 B", offset=(0, 0.05), size=size)
    _flow_arrow(ax, (4.45, 1.25), (5.1, 1.25), "2 B", offset=(0, -0.32), size=size)
    ax.text(5.82, 0.72, "gradient down,\nweights up (PCIe)", ha="center", va="center", fontsize=size)
    _flow_arrow(ax, (1.45, 3.3), (5.5, 2.9), style="-|>", colour="#777777")
    ax.text(3.37, 3.62, "GPUDirect Storage: drive to GPU memory, no host copy", ha="center",
            fontsize=size, color="#555555")
    fig.tight_layout()
    return _save(fig, path)


def two_slot_commit(path: Path) -> Path:
    """One file, two slots: a commit writes the idle slot, flushes, then flips its header."""
    size = FIG8_TEXT
    fig, ax = plt.subplots(figsize=(6.6, 2.4))
    ax.set_xlim(0, 6.6)
    ax.set_ylim(0.3, 2.7)
    ax.axis("off")
    rows = [(1.75, ("slot 0: step s\n(current, untouched)", COLOURS["host"]),
             ("slot 1: being written\nwith step s + 1", COLOURS["cpu"])),
            (0.95, ("header 0:\nstep s", "white"), ("header 1: step s − 1,\nthen step s + 1", "white"))]
    for y, left, right in rows:
        _flow_box(ax, 0.05, y, 2.0, 0.7, left[0], left[1], size=size)
        _flow_box(ax, 2.2, y, 2.05, 0.7, right[0], right[1], size=size)
    phases = [(2.25, "1. write slot 1"), (1.9, "2. flush: data on disk"),
              (1.45, "3. write header 1"), (1.1, "4. flush: step s + 1 holds")]
    for y, text in phases:
        ax.text(4.75, y, text, fontsize=size, va="center")
    _flow_arrow(ax, (4.7, 2.25), (4.27, 2.1), colour="#d62728")
    _flow_arrow(ax, (4.7, 1.45), (4.27, 1.3), colour="#d62728")
    ax.text(4.75, 0.6, "reopening: the newest\nintact header wins", fontsize=size, va="center",
            style="italic")
    fig.tight_layout()
    return _save(fig, path)


DIAGRAMS = {"pcie_topology.svg": pcie_topology, "offload_step.svg": offload_step, "double_buffer.svg": double_buffer,
            "nvme_path.svg": nvme_path, "two_slot_commit.svg": two_slot_commit}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"folder for the SVG files (default: {OUT})")
    args = parser.parse_args(argv)
    for name, draw in DIAGRAMS.items():
        print(f"wrote {draw(args.out / name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
