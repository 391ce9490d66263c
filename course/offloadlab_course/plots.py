"""Figures for the book, drawn with matplotlib in one style; each function returns its Figure.

``STYLE`` is the book's matplotlib style. Every figure here is drawn in it, and `make env`
installs an IPython kernel setting (etc/ipython_kernel_config.py) that gives every figure a
notebook draws the same style and SVG output, on the site, in JupyterLab and in the PDF. The
sizes are chosen for reading on a phone: a figure 5.6 in wide shown in the 342 px column of a
390 px screen still draws its smallest text (11 pt) at 9.5 CSS px, and at 14.7 px at its own
size on a laptop.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

# Imported with the module, not at the first figure: a notebook imports this in its first cell, and
# an interrupt that lands in a half-done import of matplotlib leaves the kernel unable to draw
# again.
import matplotlib.pyplot as plt
import numpy as np

from offloadlab import memory, sharding
from offloadlab.units import check_integer, format_count, parse_count

__all__ = [
    "STYLE",
    "book_style",
    "log_scale",
    "state_vs_model_size",
    "state_breakdown",
    "who_holds_what",
    "held_per_param",
    "ladder",
    "timeline",
]

# The smallest text any figure of the book carries, in points, and the width it is drawn at.
SMALLEST_TEXT_PT = 11.0
FIGURE_WIDTH_IN = 5.6

STYLE = MappingProxyType(
    {
        "figure.figsize": (FIGURE_WIDTH_IN, 3.5),
        "font.size": 12.0,
        "axes.titlesize": 12.5,
        "axes.titlelocation": "left",
        "axes.labelsize": 12.0,
        "xtick.labelsize": SMALLEST_TEXT_PT,
        "ytick.labelsize": SMALLEST_TEXT_PT,
        "legend.fontsize": SMALLEST_TEXT_PT,
        "legend.title_fontsize": SMALLEST_TEXT_PT,
        "figure.titlesize": 12.5,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "axes.grid": True,
        "axes.axisbelow": True,
        "grid.color": "0.88",
        "grid.linewidth": 0.6,
        "lines.linewidth": 1.8,
        "lines.markersize": 6.0,
        "legend.frameon": False,
        "figure.constrained_layout.use": False,
        "savefig.bbox": "tight",
        "savefig.pad_inches": 0.05,
        # Text stays text in SVG: sharp at any size, searchable, and measured by the site's tests.
        "svg.fonttype": "none",
        "svg.hashsalt": "offloadlab",
    }
)


def book_style():
    """A context in which matplotlib draws in the book's style: ``with plots.book_style(): ...``.

    The backend is loaded first. Pyplot loads it only when the first figure is made, and
    Jupyter's inline backend applies its settings (etc/ipython_kernel_config.py: SVG, this
    style) as it loads; loaded inside the context, those settings would leave with it, and
    every later figure of the notebook would lose them.
    """
    import importlib

    import matplotlib

    backend = matplotlib.get_backend()
    if backend.startswith("module://"):
        importlib.import_module(backend.removeprefix("module://"))
    return matplotlib.rc_context(STYLE)


def _plain_number(value: float) -> str:
    """A tick label as a reader writes the number: 0.5, 2, 40, 1,000 (never 4×10¹)."""
    if value >= 1e4:
        return f"{value:,.0f}"
    return f"{value:g}"


def log_scale(ax, axis: str = "y", base: int = 10, label=None) -> None:
    """Put ``axis`` ("x" or "y") of ``ax`` on a log scale labelled in plain numbers.

    Base 10 labels each decade (1, 10, 100) and, on an axis that spans less than two decades,
    the 2s and 5s between them too; base 2 labels powers of two (1, 2, 4, 8), as many as the
    axis has room for. ``label`` turns a tick's value into its text (``units.format_size`` for
    bytes, say; then at most five ticks, as such texts run longer); the default writes the
    number. Matplotlib's own labels for a short log axis read "4×10¹, 3×10¹, … 6×10⁰", and its
    powers of two carry superscripts smaller than the book's smallest text.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    if axis not in ("x", "y"):
        raise ValueError(f"axis: expected 'x' or 'y'; got {axis!r}")
    if base not in (2, 10):
        raise ValueError(f"base: expected 2 or 10; got {base!r}")
    getattr(ax, f"set_{axis}scale")("log", base=base)
    target = ax.xaxis if axis == "x" else ax.yaxis
    text = label or _plain_number
    # long labels: fewer
    target.set_major_locator(LogLocator(base=base, numticks=5 if label else "auto"))
    target.set_major_formatter(FuncFormatter(lambda value, _pos: text(value)))
    if base == 2:
        target.set_minor_locator(NullLocator())
        return

    def minor(value, _pos):
        low, high = sorted(target.get_view_interval())
        mantissa = value / 10 ** np.floor(np.log10(value) + 1e-9)
        short = high / max(low, 1e-300) < 100
        return text(value) if short and any(np.isclose(mantissa, (2, 5))) else ""

    target.set_minor_locator(LogLocator(base=10, subs=np.arange(2, 10)))
    target.set_minor_formatter(FuncFormatter(minor))


def _per_param_text(bytes_per_param: float) -> str:
    """10.00390625 reads "≈10 B/param"; a whole or short number as it is ("16 B/param")."""
    short = f"{bytes_per_param:.3g}"
    return f"{short} B/param" if float(short) == bytes_per_param else f"≈{short} B/param"


def state_vs_model_size(recipes=("mixed-adam", "bf16-adam", "adam-8bit"), params_range=(1e8, 1e12)):
    """Training state (GB) against parameter count (log–log), with common card sizes across it."""
    low, high = (parse_count(p, "params_range") for p in params_range)
    if low >= high:
        raise ValueError(
            f"params_range: expected (low, high) with low < high; got {params_range!r}"
        )
    params = np.logspace(np.log10(low), np.log10(high), 200)
    with book_style():
        fig, ax = plt.subplots(figsize=(FIGURE_WIDTH_IN, 3.9))
        for name in recipes:
            per_param = memory.get_recipe(name).total
            ax.plot(
                params, params * per_param / 1e9, label=f"{name} ({_per_param_text(per_param)})"
            )
        for label, size in memory.GPU_SIZES.items():
            ax.axhline(size / 1e9, color="0.45", lw=0.8, ls="--")
            ax.text(
                high / 1.15,
                size / 1e9 * 1.08,
                f"{label} card",
                color="0.3",
                ha="right",
                va="bottom",
                fontsize=SMALLEST_TEXT_PT,
            )
        ax.set_xscale("log")
        log_scale(ax, "y")
        ax.set_xlabel("parameters")
        ax.set_ylabel("persistent training state (GB)")
        ax.xaxis.set_major_formatter(lambda x, _pos: format_count(x))
        ax.legend(loc="upper left")
        ax.set_title("Model state against GPU memory")
        fig.tight_layout()
    return fig


_SOURCE_STYLE = {
    "measured": ("o", "tab:blue"),
    "emulated": ("s", "tab:orange"),
    "nominal": ("D", "tab:grey"),
}


def ladder(mine: dict, reference: dict | None = None, title: str = "The memory-tier ladder"):
    """Capacity against bandwidth (log–log) for each tier, with the host links drawn across.

    ``mine`` and ``reference`` are ladders from :mod:`offloadlab.ladder`; every point is
    marked by its source (measured, emulated, nominal), and rows without a figure are left out.
    The links are named in the right margin, moved apart so that no two names overlap.
    """

    with book_style():
        fig, ax = plt.subplots(figsize=(FIGURE_WIDTH_IN, 4.4))
        labelled, names = set(), []
        for which, data in (("this machine", mine), ("reference", reference)):
            if not data:
                continue
            for tier in data["tiers"]:
                capacity, rate = tier.get("capacity_bytes"), tier.get("bandwidth_bytes_per_s")
                if not capacity or not rate:
                    continue
                marker, colour = _SOURCE_STYLE.get(tier["source"], ("x", "black"))
                key = f"{which}, {tier['source']}"
                ax.scatter(
                    capacity / 1e9,
                    rate / 1e9,
                    marker=marker,
                    color=colour,
                    s=60,
                    zorder=3,
                    facecolors="none" if which == "reference" else colour,
                    label=None if key in labelled else key,
                )
                labelled.add(key)
                names.append(
                    ax.annotate(
                        tier["name"],
                        (capacity / 1e9, rate / 1e9),
                        textcoords="offset points",
                        xytext=(0, -9),
                        ha="center",
                        va="top",
                        fontsize=SMALLEST_TEXT_PT,
                        bbox={
                            "boxstyle": "square,pad=0.1",
                            "facecolor": "white",
                            "edgecolor": "none",
                            "alpha": 0.85,
                        },
                    )
                )
        # The links as horizontal lines: the bandwidth cliff is the gap between HBM and these.
        lines = [
            (
                link["bandwidth_bytes_per_s"],
                f"{link['name']} ({link['source']})",
                which == "reference",
            )
            for which, data in (("this machine", mine), ("reference", reference))
            if data
            for link in data["links"]
            if link.get("bandwidth_bytes_per_s")
            and "disk" not in link["name"]
            and "GPU → host" not in link["name"]
        ]
        for rate, _, is_reference in lines:
            ax.axhline(
                rate / 1e9,
                color="grey" if is_reference else "tab:orange",
                ls=":" if is_reference else "--",
                lw=0.9,
            )
        log_scale(ax, "x")
        log_scale(ax, "y")
        ax.margins(x=0.25, y=0.2)
        ax.set_xlabel("capacity (GB)")
        ax.set_ylabel("bandwidth (GB/s)")
        ax.set_title(title)
        handles, labels = ax.get_legend_handles_labels()
        fig.legend(
            handles,
            labels,
            loc="lower left",
            ncol=2,
            bbox_to_anchor=(0.0, 0.0),
            borderaxespad=0.2,
            columnspacing=1.2,
            handletextpad=0.3,
        )  # under the plot, where it hides no tier
        fig.tight_layout(rect=(0, 0.08, 0.64, 1))  # the right third holds the links' names
        ax.autoscale_view()
        for name in names:  # a tier's name stays inside the axes: near an edge it runs inwards
            across = ax.transAxes.inverted().transform(ax.transData.transform(name.xy))[0]
            if across > 0.7 or across < 0.3:
                name.set_horizontalalignment("right" if across > 0.7 else "left")
                name.xyann = (6 if across > 0.7 else -6, -9)
        _label_lines_at_the_right(fig, ax, [(rate / 1e9, text) for rate, text, _ in lines])
    return fig


def _wrapped(text: str, width: int = 20) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False))


def _label_lines_at_the_right(fig, ax, lines, fontsize: float = SMALLEST_TEXT_PT):
    """Name horizontal lines (y, text) beside the axes, right of the plot, moved apart so no two
    overlap.

    Links of similar bandwidth (PCIe gen 4 and 5, InfiniBand) lie close together on a log scale;
    their names go in the margin, wrapped to a narrow column, each placed at its line or, when
    that is taken, just above the name below it, with a thin leader to its line. Spacing comes
    from each name's drawn height, so it holds at any font size.
    """
    if not lines:
        return
    ax.autoscale_view()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    to_pixels, to_data = ax.transData, ax.transData.inverted()
    transform = ax.get_yaxis_transform()
    names = []
    for y, text in sorted(lines):
        name = ax.annotate(
            _wrapped(text),
            xy=(1.0, y),
            xycoords=transform,
            xytext=(1.04, y),
            textcoords=transform,
            va="center",
            ha="left",
            fontsize=fontsize,
            color="0.25",
            annotation_clip=False,
            arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "grey", "shrinkA": 0, "shrinkB": 0},
        )
        names.append((y, name, name.get_window_extent(renderer).height))
    gap = 0.5 * fontsize * fig.dpi / 72  # between two names, in pixels
    top = ax.get_window_extent().y1
    centres, previous_top = [], -np.inf
    for y, _, height in names:  # bottom up: each at its line, or just above the one below
        centre = max(to_pixels.transform((1, y))[1], previous_top + gap + height / 2)
        centres.append(centre)
        previous_top = centre + height / 2
    # names pushed above the top come back down, keeping their spacing
    overflow = previous_top - top
    if overflow > 0:
        centres = [c - overflow for c in centres]
    for (_, name, _), centre in zip(names, centres):
        name.set_position((1.04, to_data.transform((0, centre))[1]))


_LANE_COLOURS = {
    "compute": "tab:blue",
    "H2D": "tab:orange",
    "D2H": "tab:green",
    "CPU": "tab:purple",
}
_MIN_BAR_PIXELS = 2.0  # an interval shorter than this still shows as a sliver, not as an empty lane


def lane_colour(name: str) -> str:
    """The colour of a lane: by its stream (compute, H2D, D2H, CPU), matched at the start of the
    name."""
    for stream, colour in _LANE_COLOURS.items():
        if name.split(",")[0].split(" (")[0].strip() == stream:
            return colour
    return "tab:grey"


def _variants(lanes) -> dict:
    """``lanes`` as {variant: {lane: intervals}}; a single variant's lanes come back under the
    name ""."""
    if not isinstance(lanes, Mapping) or not lanes:
        raise ValueError(
            f"lanes: expected a non-empty mapping of lane names to (start, end, label) intervals, "
            f"or of variant names to such mappings; got {lanes!r}"
        )
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
                    raise ValueError(
                        f"lanes: interval {label!r} in {name!r}{where} ends before it starts"
                    )
    return variants


def timeline(lanes: Mapping, title: str = "Timeline", source: str = "measured"):
    """Recorded or predicted intervals, one horizontal lane per stream, one time axis per variant.

        ``lanes`` is either one variant, a mapping of lane name (compute, H2D, D2H, CPU; a suffix
        such as ``"H2D, one buffer"`` keeps the colour) to a list of ``(start, end, label)`` in
        seconds, or several: a mapping of variant name to such a mapping. Variants are drawn as
        small multiples, one axis each, each starting at its own first event (time 0), all on the
        same scale, so the lengths of their steps compare by eye. Times are shown in ms. An interval
        too short to see at that scale is drawn 2 pixels wide, so a lane with work in it never looks
        empty; intervals that
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

    with book_style():
        heights = [0.45 + 0.34 * len(variant_lanes) for variant_lanes in variants.values()]
        fig, axes = plt.subplots(
            len(variants),
            1,
            figsize=(FIGURE_WIDTH_IN, 0.75 + sum(heights)),
            sharex=True,
            gridspec_kw={"height_ratios": heights},
            squeeze=False,
        )
        fig.canvas.draw()  # the axes' pixel widths, for the shortest visible bar
        renderer = fig.canvas.get_renderer()
        for ax, (variant, variant_lanes) in zip(axes[:, 0], variants.items()):
            zero = spans[variant][0]
            pixels_per_ms = max(ax.get_window_extent().width, 1.0) / (longest_ms * 1.02)
            min_width_ms = _MIN_BAR_PIXELS / pixels_per_ms
            names = list(variant_lanes)
            for row, name in enumerate(names):
                colour = lane_colour(name)
                for start, end, label in variant_lanes[name]:
                    left, width = (start - zero) * 1e3, (end - start) * 1e3
                    # A thin white edge parts back-to-back intervals; a bar at the minimum width
                    # keeps its fill.
                    edge = 0.5 if width > 3 * min_width_ms else 0
                    ax.barh(
                        row,
                        max(width, min_width_ms),
                        left=left,
                        height=0.7,
                        color=colour,
                        edgecolor="white",
                        linewidth=edge,
                    )
                    if label:  # named inside its bar when the name fits there, else left unnamed
                        text = ax.text(
                            left + width / 2,
                            row,
                            label,
                            ha="center",
                            va="center",
                            fontsize=SMALLEST_TEXT_PT,
                            color="white",
                        )
                        if text.get_window_extent(renderer).width > width * pixels_per_ms - 4:
                            text.remove()
            ax.set_yticks(
                range(len(names)),
                [name.split(",")[0].split(" (")[0] if variant else name for name in names],
            )
            ax.set_ylim(len(names) - 0.5, -0.5)
            if variant:
                step_ms = (spans[variant][1] - zero) * 1e3
                ax.set_title(f"{variant}: {step_ms:.3g} ms", loc="left", fontsize=12)
            ax.grid(False)
            ax.grid(axis="x", color="0.88", lw=0.6)
            ax.tick_params(axis="y", length=0)
        axes[0, 0].set_xlim(0, longest_ms * 1.02)
        axes[-1, 0].set_xlabel(
            "time from the variant's first event (ms)" if len(variants) > 1 else "time (ms)"
        )
        fig.suptitle(f"{title} ({source})", x=0.02, ha="left")
        fig.tight_layout()
    return fig


# One colour per kind of state: the two the passes use in blues, the optimizer's own in oranges.
_KIND_COLOURS = {
    "weights": "#2166ac",
    "gradients": "#67a9cf",
    "master_weights": "#b35806",
    "first_moment": "#f1a340",
    "second_moment": "#fdb863",
    "quantization_scales": "#7f3b08",
    "fp32 gradient shard": "#4d9221",
}
_KIND_LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "master_weights": "fp32 master weights",
    "first_moment": "first moment",
    "second_moment": "second moment",
    "quantization_scales": "8-bit scales",
    "fp32 gradient shard": "fp32 gradient shard",
}


def state_breakdown(
    recipes=("mixed-adam", "mixed-adam-fp32-grads", "fp32-adam", "bf16-adam", "adam-8bit"),
):
    """Bytes per parameter of each recipe as one stacked bar, segment by kind of state.

    The kinds only the optimizer's update touches are drawn in oranges, the weights and gradients
    the forward and backward passes use in blues; each segment wide enough to hold it is labelled
    with its bytes.
    """
    names = list(recipes)
    if not names:
        raise ValueError("recipes: expected one or more recipe names; got none")
    chosen = [memory.get_recipe(name) for name in names]
    with book_style():
        fig, ax = plt.subplots(figsize=(FIGURE_WIDTH_IN, 1.9 + 0.5 * len(chosen)))
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        seen = set()
        for row, recipe in enumerate(chosen):
            left = 0.0
            for kind in memory.KINDS:
                size = recipe.bytes_per_param.get(kind, 0)
                if not size:
                    continue
                label = _KIND_LABELS[kind]
                ax.barh(
                    row,
                    size,
                    left=left,
                    height=0.62,
                    color=_KIND_COLOURS[kind],
                    edgecolor="white",
                    linewidth=1,
                    label=None if label in seen else label,
                )
                seen.add(label)
                if size >= 1:
                    ax.text(
                        left + size / 2, row, f"{size:g}", ha="center", va="center", color="white"
                    )
                left += size
            ax.text(left + 0.2, row, f"{recipe.total:.3g} B", va="center")
        ax.set_yticks(range(len(chosen)), names)
        ax.set_ylim(len(chosen) - 0.5, -0.5)
        ax.set_xlim(0, max(r.total for r in chosen) * 1.15)
        ax.set_xlabel("bytes of persistent state per parameter")
        ax.grid(False)
        ax.tick_params(axis="y", length=0)
        ax.set_title("Where the bytes per parameter go")
        fig.legend(
            *ax.get_legend_handles_labels(),
            ncol=3,
            loc="lower center",
            columnspacing=1.0,
            handlelength=1.2,
            handletextpad=0.4,
        )
        fig.tight_layout(rect=(0, 0.15, 1, 1))
        # A segment's number stays only where it fits inside the segment.
        for text in [t for t in ax.texts if t.get_color() == "white"]:
            segment = next(
                p
                for p in ax.patches
                if p.contains_point(ax.transData.transform(text.get_position()))
            )
            if (
                text.get_window_extent(renderer).width
                > segment.get_window_extent(renderer).width - 2
            ):
                text.remove()
    return fig


def held_per_param(strategy: str, gpus: int, recipe: str = memory.DEFAULT_RECIPE) -> dict:
    """Bytes of model state per parameter one GPU holds under ``strategy`` (no offload), by kind.

    Each value is (bytes, sharded): a sharded kind is the GPU's 1/``gpus`` share. Gathered
    weights (ZeRO-3, FSDP2's working set) are left out; the totals are
    :func:`offloadlab.sharding.layout`'s ``gpu_bytes`` per parameter for a model without them.
    """
    if strategy not in sharding.STRATEGIES:
        raise ValueError(
            f"strategy: expected one of {', '.join(sharding.STRATEGIES)}; got {strategy!r}"
        )
    check_integer(gpus, "gpus")
    kinds = memory.get_recipe(recipe).bytes_per_param
    w = kinds["weights"]
    optimizer = {
        k: kinds[k] for k in ("master_weights", "first_moment", "second_moment") if k in kinds
    }
    share, fp32 = 1 / gpus, sharding.DEEPSPEED_FP32_GRADIENT
    # the sharded fp32 parameters are the master copy; gradients take their dtype
    if strategy == "fsdp2":
        master = kinds.get("master_weights", 0) or w
        moments = {k: v * share for k, v in optimizer.items() if k != "master_weights"}
        return {
            "master_weights": (master * share, True),
            "gradients": (master * share, True),
            **{k: (v, True) for k, v in moments.items()},
        }
    whole = {
        "ddp": ("weights", "gradients"),
        "zero1": ("weights", "gradients"),
        "zero2": ("weights",),
        "zero3": (),
    }[strategy]
    split = {"ddp": (), "zero1": (), "zero2": ("gradients",), "zero3": ("weights",)}[strategy]
    held = {kind: (kinds[kind], False) for kind in whole}
    held.update({kind: (kinds[kind] * share, True) for kind in split})
    # DeepSpeed's fp32 copy of the rank's gradient partition, read by its optimizer
    if strategy != "ddp":
        held["fp32 gradient shard"] = (fp32 * share, True)
    for kind, size in optimizer.items():
        held[kind] = (size, False) if strategy == "ddp" else (size * share, True)
    return held


def who_holds_what(
    gpus: int = 4,
    strategies=("ddp", "zero1", "zero2", "zero3", "fsdp2"),
    recipe: str = memory.DEFAULT_RECIPE,
):
    """For each strategy, the bytes per parameter each of ``gpus`` GPUs holds, stacked by kind.

    A kind every GPU holds whole is drawn solid; a sharded kind is hatched and labelled with the
    shard the GPU owns (k/N), so the picture shows who holds what, not only how much. The
    strategies sit three to a row, so that the figure keeps the book's width and text size; the
    legend takes the place left over (or a row of its own).
    """
    names = list(strategies)
    if not names:
        raise ValueError(
            "strategies: expected one or more of " + ", ".join(sharding.STRATEGIES) + "; got none"
        )
    labels = {
        "ddp": "data parallel",
        "zero1": "ZeRO-1",
        "zero2": "ZeRO-2",
        "zero3": "ZeRO-3",
        "fsdp2": "FSDP2",
    }
    columns = min(3, len(names))
    rows = -(-len(names) // columns)
    spare = rows * columns - len(names)  # empty places, where the legend goes
    with book_style():
        fig, axes = plt.subplots(
            rows + (spare == 0),
            columns,
            figsize=(FIGURE_WIDTH_IN, 2.6 * rows + 1.4 * (spare == 0)),
            sharey=True,
            squeeze=False,
        )
        seen, panels = set(), list(axes.flat)
        for ax, strategy in zip(panels, names):
            held = held_per_param(strategy, gpus, recipe)
            for gpu in range(gpus):
                bottom = 0.0
                for kind, (size, sharded) in held.items():
                    # FSDP2's gradients take the fp32 shard's dtype
                    fp32 = strategy == "fsdp2" and kind == "gradients"
                    label = (
                        "fp32 gradients"
                        if fp32
                        else f"16-bit {kind}"
                        if kind in ("weights", "gradients")
                        else _KIND_LABELS[kind]
                    )
                    colour = _KIND_COLOURS["fp32 gradient shard" if fp32 else kind]
                    ax.bar(
                        gpu,
                        size,
                        bottom=bottom,
                        width=0.78,
                        color=colour,
                        edgecolor="white",
                        linewidth=0.6,
                        hatch="///" if sharded else None,
                        label=None if label in seen else label,
                    )
                    seen.add(label)
                    bottom += size
                if gpu == 0 or gpus <= 2:  # the totals are the same on every GPU: said once
                    ax.text(gpu, bottom + 0.3, f"{bottom:.3g}", ha="center")
            ax.set_title(labels[strategy], loc="center")
            ax.set_xticks(range(gpus), [str(i) for i in range(gpus)])
            ax.tick_params(axis="x", length=0)
            ax.grid(False)
            ax.grid(axis="y", color="0.9", lw=0.6)
        for ax in panels[len(names) :]:
            fig.delaxes(ax)
        for ax in axes[:, 0]:
            if ax in fig.axes:
                ax.set_ylabel("B per parameter")
        handles, texts = [], []
        for ax in panels[: len(names)]:
            h, t = ax.get_legend_handles_labels()
            handles, texts = handles + h, texts + t
        fig.supxlabel("GPU (its shard)", fontsize=SMALLEST_TEXT_PT)
        fig.suptitle(f"Who holds what on {gpus} GPUs\n(hatched: each GPU's own 1/{gpus} shard)")
        fig.tight_layout()
        if spare:  # in the first empty place: right of the last panel of the last row
            last = panels[len(names) - 1].get_position()
            fig.legend(
                handles,
                texts,
                loc="center left",
                bbox_to_anchor=(last.x1 + 0.01, (last.y0 + last.y1) / 2),
                handlelength=0.9,
                handletextpad=0.3,
                borderaxespad=0,
                borderpad=0,
            )
        else:
            fig.legend(
                handles, texts, loc="lower center", ncol=2, handlelength=1.2, handletextpad=0.4
            )
    return fig
