"""Draw the book's explanatory diagrams as SVG files under book/figures/.

The diagrams are committed so the site builds offline without running this script; run it
after changing one (`python tools/diagrams.py`) and commit the SVG it writes. Text stays text
in the SVG (searchable, and read by screen readers beside the figure's alt text), and the
output is byte-stable: no date, fixed element ids.

Each is drawn for a phone first: at most ``WIDTH_IN`` wide, stacked top to bottom rather than
side by side, and no text smaller than ``SMALLEST_PT``. Shown in the 342 px column of a 390 px
screen that is still 9 CSS px; at its own size on a laptop, 13 px. The caption belongs to the
chapter's figure directive, not to the picture: the diagrams carry labels only.

- ``pcie_topology.svg`` (chapter 4): host above, GPU below, joined by PCIe, a copy engine per
  direction.
- ``offload_step.svg`` (chapter 6): one step of CPUOffloadAdam — gradients gathered into buckets
  on the GPU, down on the device→host engine, updated on the CPU, weights up on the host→device
  engine.
- ``double_buffer.svg`` (chapter 7): two device buffers taking turns, and the two events that
  order each refill.
- ``nvme_path.svg`` (chapter 8): optimizer state from the drives through pinned host memory to
  the CPU update and back, a chunk at a time; the GPU's 4 bytes per parameter below it.
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
WIDTH_IN = 5.2  # the widest a diagram is drawn, in inches (points / 72)
SMALLEST_PT = 10  # the smallest text in any diagram, in points
TITLE_PT = 11.5  # a box's title
GREY, EDGE, LINK = "#4d4d4d", "#444444", "#b35806"
COLOURS = {
    "host": "#e5f2dc",
    "gpu": "#dbe9f6",
    "engine": "#fbe7c6",
    "cpu": "#f6d6d6",
    "plain": "white",
}
COPY_WAIT, RELEASE_WAIT = "#1f77b4", "#d62728"  # the chapter's text calls them blue and red


def _canvas(height_in: float):
    """A blank figure WIDTH_IN wide, its axes in inches (x from 0 to WIDTH_IN, y from 0 up)."""
    fig = plt.figure(figsize=(WIDTH_IN, height_in))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, WIDTH_IN)
    ax.set_ylim(0, height_in)
    ax.axis("off")
    return fig, ax


def _box(ax, x, y, w, h, title="", lines=(), face="white", title_size=TITLE_PT, edge=EDGE):
    """A rounded box with a bold title at its top and lines of text below it (or centred lines)."""
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.06",
            facecolor=face,
            edgecolor=edge,
            linewidth=1,
        )
    )
    if title:
        ax.text(
            x + w / 2,
            y + h - 0.08,
            title,
            ha="center",
            va="top",
            fontsize=title_size,
            weight="bold",
        )
        top = y + h - 0.08 - title_size / 72 * 1.35
        for i, line in enumerate(lines):
            ax.text(
                x + w / 2,
                top - SMALLEST_PT / 72 * 1.3 * i,
                line,
                ha="center",
                va="top",
                fontsize=SMALLEST_PT,
                color=GREY,
            )
    else:
        ax.text(
            x + w / 2,
            y + h / 2,
            "\n".join(lines),
            ha="center",
            va="center",
            fontsize=SMALLEST_PT,
            linespacing=1.25,
        )


def _arrow(ax, start, end, colour=EDGE, width=1.3, both=False):
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle="<|-|>" if both else "-|>",
            mutation_scale=12,
            color=colour,
            linewidth=width,
            shrinkA=0,
            shrinkB=0,
        )
    )


def _label(
    ax,
    x,
    y,
    text,
    ha="left",
    colour="black",
    weight="normal",
    size=SMALLEST_PT,
    style="normal",
    backed=False,
):
    """Text at (x, y); ``backed`` paints the page colour behind it, so arrows it crosses pass
    behind it."""
    backing = (
        {"boxstyle": "square,pad=0.15", "facecolor": "white", "edgecolor": "none"}
        if backed
        else None
    )
    ax.text(
        x,
        y,
        text,
        ha=ha,
        va="center",
        fontsize=size,
        color=colour,
        weight=weight,
        style=style,
        linespacing=1.2,
        bbox=backing,
        zorder=3 if backed else None,
    )


def pcie_topology(path: Path) -> Path:
    """Host above, GPU below, joined by PCIe: one copy engine per direction, host DRAM shared by
    all."""
    nominal, achievable = PCIE_X16["PCIe 4.0 ×16"]
    fig, ax = _canvas(6.75)

    # The host: CPU cores and DRAM behind one memory bus, reached by the GPU through the root
    # complex.
    _box(ax, 0.05, 3.85, 5.1, 2.85, "host", face=COLOURS["host"], title_size=12)
    _box(
        ax,
        0.2,
        5.55,
        3.3,
        0.8,
        "CPU cores",
        ["the Adam update: reads 12 B +", "gradient, writes 12 B + weights"],
    )
    _box(
        ax,
        0.2,
        4.6,
        4.8,
        0.65,
        "host DRAM (pinned buffers)",
        ["master weights, moments, gradients, weights"],
    )
    _box(ax, 0.2, 4.0, 4.8, 0.35, "", ["PCIe root complex"])
    _arrow(ax, (1.85, 5.53), (1.85, 5.27), both=True)
    _label(ax, 1.95, 5.4, "memory bus, shared", colour=GREY)
    _arrow(ax, (2.6, 4.58), (2.6, 4.37), both=True)
    _label(ax, 2.7, 4.47, "DMA", colour=GREY)

    # The link: 16 lanes, each with a wire pair per direction, so both directions run at once.
    _arrow(ax, (0.95, 3.98), (0.95, 2.17), colour=LINK, width=2.2)
    _label(
        ax,
        1.07,
        3.25,
        f"host → GPU\n{achievable / 1e9:.0f} GB/s\n({nominal / 1e9:.1f} nominal)",
        colour=LINK,
    )
    _arrow(ax, (4.25, 2.17), (4.25, 3.98), colour=LINK, width=2.2)
    _label(
        ax,
        4.13,
        3.25,
        f"GPU → host\n{achievable / 1e9:.0f} GB/s\n({nominal / 1e9:.1f} nominal)",
        ha="right",
        colour=LINK,
    )
    _label(
        ax,
        2.6,
        2.65,
        "PCIe 4.0 ×16:\n16 lanes, each\nfull duplex",
        ha="center",
        colour=LINK,
        weight="bold",
    )

    # The GPU: one copy engine per direction, beside the SMs, all writing and reading HBM.
    _box(ax, 0.05, 0.05, 5.1, 2.35, "GPU", face=COLOURS["gpu"], title_size=12)
    _box(ax, 0.2, 1.3, 1.5, 0.85, "copy engine", ["host → GPU"], title_size=SMALLEST_PT + 0.5)
    _box(ax, 1.85, 1.3, 1.5, 0.85, "SMs", ["forward, backward"], title_size=SMALLEST_PT + 0.5)
    _box(ax, 3.5, 1.3, 1.5, 0.85, "copy engine", ["GPU → host"], title_size=SMALLEST_PT + 0.5)
    _box(
        ax,
        0.2,
        0.2,
        4.8,
        0.75,
        "HBM",
        ["16-bit weights, activations, gradients"],
        title_size=SMALLEST_PT + 0.5,
    )
    for x in (0.95, 2.6, 4.25):
        _arrow(ax, (x, 1.28), (x, 0.97), both=True)
    return _save(fig, path)


def offload_step(path: Path) -> Path:
    """One CPUOffloadAdam step: buckets down on one engine, the CPU update, weights up on the
    other."""
    fig, ax = _canvas(6.5)
    # the GPU
    _box(ax, 0.05, 4.75, 5.1, 1.7, "GPU", face=COLOURS["gpu"], title_size=12)
    _box(
        ax,
        0.2,
        4.9,
        2.45,
        1.1,
        "",
        ["backward: gradients,", "bucket by bucket, into", "a flat buffer, then freed"],
    )
    _box(ax, 2.8, 4.9, 2.2, 1.1, "", ["parameters (bf16):", "2 B each"])
    # the copy engines, one per direction
    _box(
        ax,
        0.3,
        3.05,
        2.05,
        0.85,
        "",
        ["copy engine", "device → host", "2 B/param down"],
        face=COLOURS["engine"],
    )
    _box(
        ax,
        2.85,
        3.05,
        2.05,
        0.85,
        "",
        ["copy engine", "host → device", "2 B/param up"],
        face=COLOURS["engine"],
    )
    _arrow(ax, (1.32, 4.88), (1.32, 3.92))
    _label(ax, 1.42, 4.42, "one copy per bucket\n(tens of MiB)")
    _arrow(ax, (3.87, 3.92), (3.87, 4.88))
    _label(ax, 3.97, 4.42, "scattered into\nthe parameters")
    _label(
        ax,
        2.6,
        2.82,
        "both engines at once (full duplex),\neach way a little under its one-way rate",
        ha="center",
        style="italic",
        backed=True,
    )
    # the host
    _box(ax, 0.05, 0.05, 5.1, 2.55, "host memory (pinned)", face=COLOURS["host"], title_size=12)
    _box(ax, 0.2, 1.4, 2.25, 0.75, "", ["landing gradients", "(bf16), 2 B/param"])
    _box(ax, 2.75, 1.4, 2.25, 0.75, "", ["outgoing weights", "(bf16), 2 B/param"])
    _box(
        ax,
        0.2,
        0.2,
        4.8,
        0.9,
        "",
        ["fp32 master weights, moments: 12 B/param,", "updated in place by the CPU (fused AdamW)"],
        face=COLOURS["cpu"],
    )
    _arrow(ax, (1.32, 3.03), (1.32, 2.17))
    _arrow(ax, (3.87, 2.17), (3.87, 3.03))
    _arrow(ax, (1.32, 1.38), (1.32, 1.12))  # once landed, into the update
    _arrow(ax, (3.87, 1.12), (3.87, 1.38))  # new weights, rounded to bf16
    return _save(fig, path)


def double_buffer(path: Path) -> Path:
    """Two device buffers taking turns, and the two events that order each refill."""
    fig, ax = _canvas(3.3)
    unit = (WIDTH_IN - 0.1) / 9.8  # one layer's copy; a compute takes 2.2
    x = lambda t: 0.05 + t * unit  # noqa: E731
    slot = {"A": "#cfe2f3", "B": "#fce5cd"}
    _label(ax, 0.05, 3.1, "copy engine (host → device)", weight="bold")
    _label(ax, 0.05, 0.7, "compute stream", weight="bold")
    fetches = [
        (0.0, 1.0, "L0→A", "A"),
        (1.0, 2.0, "L1→B", "B"),
        (3.2, 4.2, "L2→A", "A"),
        (5.4, 6.4, "L3→B", "B"),
    ]
    computes = [
        (1.0, 3.2, "L0 in A", "A"),
        (3.2, 5.4, "L1 in B", "B"),
        (5.4, 7.6, "L2 in A", "A"),
        (7.6, 9.8, "L3 in B", "B"),
    ]
    for start, end, text, buffer in fetches:
        _box(ax, x(start), 2.3, (end - start) * unit - 0.04, 0.55, "", [text], face=slot[buffer])
    for start, end, text, buffer in computes:
        _box(ax, x(start), 0.95, (end - start) * unit - 0.04, 0.55, "", [text], face=slot[buffer])
    # copy event: compute waits for its layer's copy
    _arrow(ax, (x(0.95), 2.28), (x(1.1), 1.52), colour=COPY_WAIT)
    _label(ax, x(1.25), 1.9, "compute waits\nfor the copy", colour=COPY_WAIT)
    # release marker: refill of A waits for L0's compute to finish with A
    _arrow(ax, (x(3.15), 1.52), (x(3.3), 2.28), colour=RELEASE_WAIT)
    _label(ax, x(4.3), 1.9, "refill waits for\nthe release", colour=RELEASE_WAIT)
    ax.annotate(
        "",
        xy=(x(9.8), 0.2),
        xytext=(x(4.0), 0.2),
        arrowprops={"arrowstyle": "-|>", "color": "#777777"},
    )
    _label(ax, x(3.9), 0.2, "time", ha="right", colour="#555555")
    return _save(fig, path)


def nvme_path(path: Path) -> Path:
    """Optimizer state on NVMe: read into pinned host memory, updated by the CPU, written back."""
    fig, ax = _canvas(6.5)
    # the drives, striped
    _box(
        ax,
        0.05,
        5.0,
        3.9,
        1.45,
        "NVMe drives, striped",
        face=COLOURS["engine"],
        title_size=TITLE_PT,
    )
    for i in range(4):
        _box(ax, 0.2 + 0.93 * i, 5.15, 0.83, 0.55, "", [f"drive {i}"])
    # the host: three chunks in flight
    _box(
        ax, 0.05, 1.95, 3.9, 2.55, "host memory (pinned)", face=COLOURS["host"], title_size=TITLE_PT
    )
    _box(ax, 0.2, 3.35, 2.9, 0.6, "", ["chunk i + 1: reads landing"])
    _box(
        ax,
        0.2,
        2.6,
        2.9,
        0.6,
        "",
        ["chunk i: CPU AdamW on", "master, m, v (fp32)"],
        face=COLOURS["cpu"],
    )
    _box(ax, 0.2, 2.1, 2.9, 0.4, "", ["chunk i − 1: writes leaving"])
    _arrow(ax, (0.55, 4.98), (0.55, 3.97))
    _label(ax, 0.65, 4.72, "12 B read")
    _arrow(ax, (3.12, 2.3), (3.5, 2.3))
    _arrow(ax, (3.5, 2.28), (3.5, 4.98))
    _label(ax, 3.4, 4.72, "12 B written", ha="right")
    _arrow(ax, (1.65, 3.33), (1.65, 3.22))
    _arrow(ax, (1.65, 2.58), (1.65, 2.52))
    # the GPU, exchanging 2 B each way over PCIe
    _box(
        ax,
        0.05,
        0.05,
        3.9,
        1.2,
        "GPU",
        ["bf16 weights, forward and backward"],
        face=COLOURS["gpu"],
        title_size=TITLE_PT,
    )
    _arrow(ax, (0.9, 1.27), (0.9, 1.93))
    _label(ax, 1.0, 1.6, "gradient, 2 B")
    _arrow(ax, (2.6, 1.93), (2.6, 1.27))
    _label(ax, 2.7, 1.6, "weights, 2 B")
    # GPUDirect Storage: from the drives straight into GPU memory
    _arrow(ax, (3.97, 5.7), (4.25, 5.7), colour="#777777")
    _arrow(ax, (4.25, 5.72), (4.25, 0.65), colour="#777777")
    _arrow(ax, (4.25, 0.65), (3.97, 0.65), colour="#777777")
    _label(ax, 4.35, 3.2, "GPUDirect\nStorage:\ndrive to\nGPU, no\nhost copy", colour="#555555")
    return _save(fig, path)


def two_slot_commit(path: Path) -> Path:
    """One file, two slots: a commit writes the idle slot, flushes, then flips its header."""
    fig, ax = _canvas(3.6)
    rows = [
        (
            2.75,
            (["slot 0: step s", "(current, untouched)"], COLOURS["host"]),
            (["slot 1: being written", "with step s + 1"], COLOURS["cpu"]),
        ),
        (
            1.95,
            (["header 0: step s"], "white"),
            (["header 1: step s − 1,", "then step s + 1"], "white"),
        ),
    ]
    for y, (left, left_face), (right, right_face) in rows:
        _box(ax, 0.05, y, 2.5, 0.7, "", left, face=left_face)
        _box(ax, 2.65, y, 2.5, 0.7, "", right, face=right_face, edge=RELEASE_WAIT)
    steps = [
        (1.55, "1. write slot 1"),
        (1.2, "2. flush: data on disk"),
        (0.85, "3. write header 1"),
        (0.5, "4. flush: step s + 1 holds"),
    ]
    for y, text in steps:  # the two writes in red, as the slot and header they write
        _label(ax, 0.1, y, text, colour=RELEASE_WAIT if "write" in text else "black")
    _label(ax, 5.1, 0.7, "reopening: the newest\nintact header wins", ha="right", style="italic")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "offloadlab"}):
        fig.savefig(
            path,
            format="svg",
            metadata={"Date": None, "Creator": None},
            bbox_inches="tight",
            pad_inches=0.02,
        )
    plt.close(fig)
    return path


DIAGRAMS = {
    "pcie_topology.svg": pcie_topology,
    "offload_step.svg": offload_step,
    "double_buffer.svg": double_buffer,
    "nvme_path.svg": nvme_path,
    "two_slot_commit.svg": two_slot_commit,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=OUT, help=f"folder for the SVG files (default: {OUT})"
    )
    args = parser.parse_args(argv)
    for name, draw in DIAGRAMS.items():
        print(f"wrote {draw(args.out / name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
