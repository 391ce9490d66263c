"""Draw the book's explanatory diagrams as SVG files under book/figures/.

The diagrams are committed so the site builds offline without running this script; run it
after changing one (`python tools/diagrams.py`) and commit the SVG it writes. Text stays text
in the SVG (searchable, and read by screen readers beside the figure's alt text), and the
output is byte-stable: no date, fixed element ids.

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

    # The link: separate lanes each way.
    rate = f"{achievable / 1e9:.0f} GB/s ({nominal / 1e9:.1f} nominal)"
    _arrow(ax, (3.97, 3.7), (6.4, 3.7), colour=LINK, width=2.2)
    ax.text(5.07, 3.82, "host → GPU lanes", ha="center", fontsize=8, color=LINK, weight="bold")
    ax.text(5.07, 3.48, rate, ha="center", fontsize=7, color=LINK)
    _arrow(ax, (6.4, 2.9), (3.97, 2.9), colour=LINK, width=2.2)
    ax.text(5.07, 3.02, "GPU → host lanes", ha="center", fontsize=8, color=LINK, weight="bold")
    ax.text(5.07, 2.68, rate, ha="center", fontsize=7, color=LINK)
    ax.text(5.07, 4.3, "PCIe 4.0 ×16", ha="center", fontsize=9, weight="bold", color=LINK)

    # The GPU: one copy engine per direction, beside the SMs, all writing and reading HBM.
    _box(ax, 6.2, 0.55, 4.05, 3.9, "GPU", face=GPU, size=10)
    _box(ax, 6.4, 3.35, 1.7, 0.7, "copy engine", ["host → GPU"], size=8)
    _box(ax, 6.4, 2.55, 1.7, 0.7, "copy engine", ["GPU → host"], size=8)
    _box(ax, 8.3, 2.55, 1.75, 1.5, "SMs", ["forward and", "backward"])
    _box(ax, 6.4, 0.75, 3.65, 1.4, "HBM", ["16-bit weights, activations,", "gradients until they leave"])
    _arrow(ax, (7.25, 2.53), (7.25, 2.17), both=True)
    _arrow(ax, (9.17, 2.53), (9.17, 2.17), both=True)

    ax.text(5.2, 0.22, "Each direction has its own lanes and its own copy engine: gradients going down and weights "
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


DIAGRAMS = {"pcie_topology.svg": pcie_topology}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"folder for the SVG files (default: {OUT})")
    args = parser.parse_args(argv)
    for name, draw in DIAGRAMS.items():
        print(f"wrote {draw(args.out / name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
