"""The book's figures: timelines whose every lane shows its work, one axis per variant on a
common scale."""

import io
import re

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from offloadlab_course import plots  # noqa: E402


def prefetch_run(
    offset: float,
    layers: int = 8,
    compute: float = 0.010,
    copy: float = 0.0002,
    serial: bool = False,
):
    """Lanes of one recorded prefetch pass starting at ``offset`` s: short copies, longer
    compute."""
    h2d, computes, t = [], [], offset
    for i in range(layers):
        h2d.append((t, t + copy, f"w{i}"))
        start = t + copy if serial or i == 0 else t
        computes.append((start, start + compute, f"layer {i}"))
        t = start + compute
    return {"H2D": h2d, "compute": computes}


def chapter_seven_variants() -> dict:
    """Four variants measured one after the other on one clock, as chapter 7 records them."""
    variants, t = {}, 0.340
    for name, serial in (
        ("double buffered", False),
        ("one buffer", True),
        ("pageable", True),
        ("synchronous", True),
    ):
        variants[name] = prefetch_run(t, serial=serial)
        t = max(end for lane in variants[name].values() for _, end, _ in lane) + 0.150
    return variants


def coloured_pixels(fig, ax, row: int, colour: str) -> int:
    """How many pixels along lane ``row`` of ``ax`` are drawn in ``colour``."""
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[:, :, :3].astype(int)
    box = ax.get_window_extent()
    _, y = ax.transData.transform((0, row))
    line = image[image.shape[0] - int(round(y)), int(box.x0) + 1 : int(box.x1) - 1]
    return int((np.abs(line - np.array(to_rgb(colour)) * 255).max(axis=1) < 12).sum())


def assert_every_lane_shows_its_work(fig, variants: dict):
    axes = fig.axes
    for ax, lanes in zip(axes, variants.values() if len(axes) > 1 else [dict(variants)]):
        for row, name in enumerate(lanes):
            colour = plots.lane_colour(name)
            assert coloured_pixels(fig, ax, row, colour) > 0, (
                f"lane {name!r} ({ax.get_title()!r}) looks empty"
            )


def test_the_flat_form_shows_every_lane_even_with_short_copies():
    """Chapter 7's call before small multiples: eight lanes on one absolute clock, copies of 0.2
    ms."""
    flat = {}
    for name, lanes in chapter_seven_variants().items():
        flat[f"H2D, {name}"], flat[f"compute, {name}"] = lanes["H2D"], lanes["compute"]
    fig = plots.timeline(flat, "Prefetch variants", source="emulated")
    assert len(fig.axes) == 1
    assert_every_lane_shows_its_work(fig, flat)


def test_variants_get_one_axis_each_from_their_own_zero_on_one_scale():
    variants = chapter_seven_variants()
    fig = plots.timeline(variants, "Prefetch variants", source="emulated")
    assert len(fig.axes) == len(variants)
    assert len({ax.get_xlim() for ax in fig.axes}) == 1  # one scale for all
    ends = []
    for ax, lanes in zip(fig.axes, variants.values()):
        bars = [patch for patch in ax.patches]
        assert min(bar.get_x() for bar in bars) == pytest.approx(0.0)  # each starts at its own zero
        ends.append(max(bar.get_x() + bar.get_width() for bar in bars))
        step_ms = (
            max(e for lane in lanes.values() for _, e, _ in lane)
            - min(s for lane in lanes.values() for s, _, _ in lane)
        ) * 1e3
        assert ends[-1] == pytest.approx(step_ms, rel=1e-6)
        assert [t.get_text() for t in ax.get_yticklabels()] == ["H2D", "compute"]
    assert ends[0] < ends[-1]  # double buffered is visibly shorter than synchronous
    assert_every_lane_shows_its_work(fig, variants)
    assert "(emulated)" in fig._suptitle.get_text()


def test_back_to_back_intervals_stay_apart():
    """Double-buffered compute runs layer after layer with no gap; the reader still counts eight."""
    lanes = chapter_seven_variants()["double buffered"]
    # no text
    variants = {
        "double buffered": {name: [(a, b, "") for a, b, _ in lane] for name, lane in lanes.items()}
    }
    fig = plots.timeline(variants, "Prefetch", source="emulated")
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[:, :, :3].astype(int)
    ax = fig.axes[0]
    box = ax.get_window_extent()
    _, y = ax.transData.transform((0, 1))  # the compute lane
    line = image[image.shape[0] - int(round(y)), int(box.x0) + 1 : int(box.x1) - 1]
    inside = (
        np.abs(line - np.array(to_rgb(plots.lane_colour("compute"))) * 255).max(axis=1) < 12
    ).astype(int)
    runs = int((np.diff(np.concatenate([[0], inside])) == 1).sum())
    assert runs == len(variants["double buffered"]["compute"])


def test_an_instant_interval_still_shows():
    fig = plots.timeline({"compute": [(0.0, 1.0, "step")], "D2H": [(0.5, 0.5, "flag")]})
    assert_every_lane_shows_its_work(fig, {"compute": [], "D2H": []})


def test_lane_colours_follow_the_stream():
    assert (
        plots.lane_colour("H2D, one buffer")
        == plots.lane_colour("H2D (hidden)")
        == plots.lane_colour("H2D")
    )
    assert plots.lane_colour("compute") != plots.lane_colour("H2D")
    assert plots.lane_colour("something else") == "tab:grey"


@pytest.mark.parametrize(
    "lanes, message",
    [
        ({}, "lanes: expected a non-empty mapping"),
        ([("compute", [])], "lanes: expected a non-empty mapping"),
        ({"a": {"compute": []}, "H2D": []}, "not a mix"),
        ({"a": {}}, "variant 'a' has no lanes"),
        ({"compute": [(2.0, 1.0, "x")]}, "interval 'x' in 'compute' ends before it starts"),
        ({"v": {"H2D": [(2.0, 1.0, "y")]}}, "interval 'y' in 'H2D' of 'v' ends before it starts"),
    ],
)
def test_bad_lanes(lanes, message):
    with pytest.raises(ValueError, match=message):
        plots.timeline(lanes)


def overlapping(boxes):
    return [
        (a, b)
        for i, (a, box_a) in enumerate(boxes)
        for b, box_b in boxes[i + 1 :]
        if box_a.overlaps(box_b)
    ]


def test_ladder_names_every_link_without_overlap():
    """Chapter 2: PCIe, InfiniBand and the measured link lie within a factor of two; their names
    must not collide."""
    from offloadlab import ladder

    mine = {
        "tiers": [
            {
                "name": "host memory",
                "capacity_bytes": 25e9,
                "bandwidth_bytes_per_s": 12e9,
                "source": "measured",
            },
            {
                "name": "disk under test",
                "capacity_bytes": 270e9,
                "bandwidth_bytes_per_s": 2.3e9,
                "source": "measured",
            },
        ],
        "links": [{"name": "host → GPU", "bandwidth_bytes_per_s": 2.1e9, "source": "emulated"}],
    }
    fig = plots.ladder(mine, ladder.nominal(), "Your ladder beside the reference node")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    # The names' text boxes (an annotation's own extent also covers its leader line).
    texts = [(t.get_text(), Text.get_window_extent(t, renderer)) for t in ax.texts if t.get_text()]
    link_names = [
        link["name"] for link in ladder.nominal()["links"] if link.get("bandwidth_bytes_per_s")
    ]
    assert sum(any(name in " ".join(text.split()) for name in link_names) for text, _ in texts) >= 3
    assert not overlapping(texts), overlapping(texts)
    assert all(box.x1 <= fig.bbox.x1 + 1 for _, box in texts), "a name runs off the figure"


def test_state_legend_rounds_bytes_per_parameter():
    """Chapter 1's legend said "adam-8bit (10.0039 B/param)": block scales make it 10.0039."""
    fig = plots.state_vs_model_size()
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["mixed-adam (16 B/param)", "bf16-adam (8 B/param)", "adam-8bit (≈10 B/param)"]


@pytest.mark.parametrize(
    "base, span, expected",
    [
        # chapter 3's step times: labelled 4×10¹, 3×10¹ … before
        (10, (1.5, 60), {"2", "5", "10", "20", "50"}),
        (10, (0.5, 2e4), {"1", "10", "100", "1000", "10,000"}),
        (2, (1, 32), {"1", "2", "4", "8", "16", "32"}),
    ],
)
def test_log_axes_read_as_plain_numbers(base, span, expected):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot(span, span)
    plots.log_scale(ax, "y", base=base)
    fig.canvas.draw()
    shown = {
        t.get_text()
        for t in ax.get_yticklabels(minor=False) + ax.get_yticklabels(minor=True)
        if t.get_text()
    }
    low, high = ax.get_ylim()
    in_view = {t for t in expected if low <= float(t.replace(",", "")) <= high}
    assert in_view <= shown and not any("10^" in t or "×" in t or "$" in t for t in shown), shown
    plt.close(fig)


def test_every_text_of_the_book_figures_is_at_least_the_smallest_size():
    from offloadlab import ladder

    mine = {
        "tiers": [
            {
                "name": "host memory",
                "capacity_bytes": 25e9,
                "bandwidth_bytes_per_s": 40e9,
                "source": "measured",
            }
        ],
        "links": [{"name": "host → GPU", "bandwidth_bytes_per_s": 2.0e9, "source": "emulated"}],
    }
    figures = [
        plots.state_vs_model_size(),
        plots.ladder(mine, ladder.nominal()),
        plots.timeline(chapter_seven_variants(), "Prefetch variants", source="emulated"),
        plots.state_breakdown(),
        plots.who_holds_what(4),
    ]
    for fig in figures:
        svg = io.StringIO()
        with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as text, each with its size
            fig.savefig(svg, format="svg", bbox_inches="tight")
        sizes = {float(size) for size in re.findall(r"font-size: ([\d.]+)px", svg.getvalue())}
        # exponents too
        assert min(sizes) >= plots.SMALLEST_TEXT_PT, (fig.axes[0].get_title(), sorted(sizes))
        width_pt = float(re.search(r'<svg[^>]* width="([\d.]+)pt"', svg.getvalue()).group(1))
        # labels included
        assert width_pt <= plots.FIGURE_WIDTH_IN * 72, (fig.axes[0].get_title(), width_pt / 72)


def test_a_notebook_draws_every_figure_as_svg_in_the_book_style(tmp_path):
    """A kernel with etc/ipython_kernel_config.py (what `make env` installs): a figure drawn by
    plots, then one a chapter draws itself, both SVG with text as text in the book's sizes. The
    first must not take the inline backend's settings away with its style context."""
    import re

    import nbclient
    import nbformat

    from tests.conftest import ROOT
    from tests.kernels import UnixSocketKernelManager

    cells = [
        "from offloadlab_course import plots\nfig = plots.state_vs_model_size()",
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([1, 2], "
        "label='a')\nax.legend()",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="python3",
        kernel_manager_class=UnixSocketKernelManager,
        resources={"metadata": {"path": str(tmp_path)}},
        extra_arguments=[f"--config={ROOT / 'etc' / 'ipython_kernel_config.py'}"],
    )
    client.execute()
    for cell in notebook.cells:
        images = [o["data"] for o in cell.outputs if o.get("output_type") == "display_data"]
        assert len(images) == 1 and "image/svg+xml" in images[0] and "image/png" not in images[0], (
            cell.source
        )
        sizes = [float(s) for s in re.findall(r"font-size: ([\d.]+)px", images[0]["image/svg+xml"])]
        assert sizes and min(sizes) >= plots.SMALLEST_TEXT_PT, (cell.source, sorted(set(sizes)))


def test_make_env_installs_the_kernel_settings():
    import sys
    from pathlib import Path

    from tests.conftest import ROOT

    installed = Path(sys.prefix) / "etc" / "ipython" / "ipython_kernel_config.py"
    assert installed.read_text() == (ROOT / "etc" / "ipython_kernel_config.py").read_text(), (
        "run `make env`"
    )
    assert "etc/ipython_kernel_config.py $(KERNEL_CONF)" in (ROOT / "Makefile").read_text()


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_who_holds_what_adds_up_to_the_sharding_layout(gpus):
    from offloadlab import sharding

    for strategy in sharding.STRATEGIES:
        held = plots.held_per_param(strategy, gpus)
        assert sum(size for size, _ in held.values()) == pytest.approx(
            sharding.layout(strategy, "none", 1.0, gpus).gpu_bytes
        ), strategy
        sharded = {kind for kind, (_, split) in held.items() if split}
        assert (
            (not sharded)
            if strategy == "ddp"
            else sharded == set(held)
            if strategy in ("zero3", "fsdp2")
            else "weights" not in sharded
        )
    fig = plots.who_holds_what(gpus)
    assert len(fig.axes) == len(sharding.STRATEGIES)


def test_the_state_breakdown_draws_each_recipe_at_its_total():
    from offloadlab import memory

    names = ("mixed-adam", "mixed-adam-fp32-grads", "adam-8bit")
    fig = plots.state_breakdown(names)
    ax = fig.axes[0]
    widths = {}
    for patch in ax.patches:
        row = round(patch.get_y() + patch.get_height() / 2)
        widths[row] = widths.get(row, 0) + patch.get_width()
    assert [pytest.approx(widths[i]) for i in range(len(names))] == [
        memory.get_recipe(n).total for n in names
    ]


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: plots.state_breakdown(()), "^recipes: "),
        (lambda: plots.state_breakdown(("teleport",)), "^recipe: "),
        (lambda: plots.held_per_param("zero4", 8), "^strategy: "),
        (lambda: plots.held_per_param("zero3", 0), "^gpus: "),
        (lambda: plots.who_holds_what(4, ()), "^strategies: "),
    ],
)
def test_the_new_figures_refuse_bad_input_in_one_line(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


def test_importing_plots_imports_matplotlib_so_no_later_cell_does():
    """A notebook imports plots in its first cell, which nobody interrupts. Were matplotlib imported
    only when the first figure is drawn, a Ctrl-C landing in that import (the end of a slow cell,
    such as lab 5's "Break it three ways") would leave half-made modules behind, and every later
    figure in that kernel would fail with an AttributeError."""
    import subprocess
    import sys

    code = "import sys; import offloadlab_course.plots; print('matplotlib.pyplot' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "True"
