"""Ctrl-C in a notebook's slowest cell, then "run from here": every chapter and lab carries on.

A reader interrupts the cell that takes longest (a sweep, a training run), reads what it has
printed, and runs the notebook again from that cell, as Lab's "Run Selected Cell and All Below"
does. Whatever the interrupted cell had half done (files written, a reference advanced by a few
steps) must not make a later cell fail. Each notebook runs twice in a real kernel: once whole,
timing every cell; then up to its slowest cell, which is interrupted (``interrupt_kernel``, as
Lab's stop button) halfway through its time, and run again from there to the end. The first
cell, which imports, is left out: interrupting ``import torch`` breaks any kernel. When nbval has
run the notebooks earlier in the same run, its cell times stand in for the first run.
"""

import contextlib
import queue
import subprocess
import sys
import threading
import time

import jupytext
import pytest

from tests.conftest import ROOT
from tests.kernels import start_kernel
from tests.nbval_markdown import CELL_SECONDS, is_text_notebook

NOTEBOOKS = sorted(
    p for d in ("book", "labs") for p in (ROOT / d).glob("*.md") if is_text_notebook(p)
)


REPLY_AFTER_INTERRUPT = 60  # seconds to wait for a reply after the kernel went idle
# A cell shorter than this is over before a reader's stop button lands: interrupting it halfway
# tests ipykernel's own reply path, not the notebook (the course page's slowest cell after its
# imports takes 8 ms; a fresh clone's kernel once died of that interrupt, under load).
SHORTEST_INTERRUPTED = 0.5  # seconds


class Kernel:
    """A real IPython kernel, started in the notebook's folder, that runs cells one at a time."""

    def __init__(self, folder):
        self.manager, self.client = start_kernel(cwd=str(folder))

    def run(self, code: str, interrupt_after: float | None = None, timeout: float = 600):
        """(status, error name, seconds) of one cell; with ``interrupt_after``, the kernel is
        interrupted that many seconds into the cell."""
        start = time.monotonic()
        msg_id = self.client.execute(
            code, store_history=True, allow_stdin=False, stop_on_error=False
        )
        timer = None
        if interrupt_after is not None:
            timer = threading.Timer(interrupt_after, self.manager.interrupt_kernel)
            timer.start()
        error = None
        try:
            while True:
                message = self.client.get_iopub_msg(timeout=timeout)
                if message["parent_header"].get("msg_id") != msg_id:
                    continue
                if message["msg_type"] == "error":
                    error = message["content"]["ename"]
                if (
                    message["msg_type"] == "status"
                    and message["content"]["execution_state"] == "idle"
                ):
                    break
            status = self.reply_status(msg_id, timeout, interrupted=timer is not None)
        except queue.Empty:
            pytest.fail(f"a cell ran longer than {timeout} s:\n{code[:300]}")
        finally:
            if timer is not None:
                timer.join()  # the interrupt is sent even if the cell finished first
        if timer is not None:
            self.settle()
        return status, error, time.monotonic() - start

    def reply_status(self, msg_id: str, timeout: float, interrupted: bool) -> str:
        """The status of the cell's own reply (replies to earlier requests are passed over: a
        slow start leaves a spare kernel_info reply), once the kernel has said it is idle again.
        An interrupt that lands while ipykernel sends the reply loses it (the kernel lives on, and
        says idle): after an interrupt, a reply that does not come is "interrupted"."""
        wait = min(timeout, REPLY_AFTER_INTERRUPT) if interrupted else timeout
        try:
            reply = self.client.get_shell_msg(timeout=wait)
            while reply["parent_header"].get("msg_id") != msg_id:
                reply = self.client.get_shell_msg(timeout=wait)
            return reply["content"]["status"]
        except queue.Empty:
            if interrupted:
                return "interrupted"
            raise

    def settle(self):
        """After an interrupt, run empty cells until one runs: an interrupt that arrived late, or
        the kernel's refusal of requests just after one (status "aborted"), must not land on the
        next cell."""
        for _ in range(20):
            time.sleep(0.2)
            msg_id = self.client.execute("pass", store_history=False, stop_on_error=False)
            reply = self.client.get_shell_msg(timeout=60)
            while reply["parent_header"].get("msg_id") != msg_id:
                reply = self.client.get_shell_msg(timeout=60)
            if reply["content"]["status"] == "ok":
                return
        pytest.fail("the kernel did not run a cell again after the interrupt")

    def close(self):
        """Remove the notebook's own scratch folder (chapter 8's, lab 7's: a TemporaryDirectory
        named ``scratch``, whose removal may be in a cell that never ran) and stop the kernel.
        Nothing else beside the notebook is touched: under make test, other runs write there."""
        with contextlib.suppress(Exception):  # (a kernel that no longer answers keeps it)
            self.run("if 'scratch' in globals(): scratch.cleanup()", timeout=60)
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def code_cells(path):
    return [c.source for c in jupytext.read(path).cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_interrupting_the_slowest_cell_and_running_on_from_it(path):
    cells = code_cells(path)
    if len(cells) < 2:
        pytest.skip("no cell to interrupt but the one that imports")
    interrupt_and_run_on(path, cells)


def cell_seconds(path, cells) -> list[float]:
    """How long each cell takes: as nbval ran it earlier in this run, or timed now in a kernel of
    its own (when this test runs without the notebooks)."""
    timed = CELL_SECONDS.get(path, {})
    if len(timed) == len(cells):
        return [timed[index] for index in range(len(cells))]
    kernel = Kernel(path.parent)
    try:
        seconds = []
        for index, code in enumerate(cells):
            status, error, took = kernel.run(code)
            assert status == "ok", f"cell {index + 1} failed on the first run: {error}"
            seconds.append(took)
    finally:
        kernel.close()
    return seconds


def interrupt_and_run_on(path, cells):
    seconds = cell_seconds(path, cells)
    # The first cell imports torch: an interrupted import leaves a half-made module in any Python
    # (re-importing torch then raises), which no notebook can undo. The slowest of the others.
    slowest = max(range(1, len(cells)), key=seconds.__getitem__)
    if seconds[slowest] < SHORTEST_INTERRUPTED:
        pytest.skip(f"no cell but the imports takes {SHORTEST_INTERRUPTED} s: none to interrupt")
    kernel = Kernel(path.parent)
    try:
        for code in cells[:slowest]:
            assert kernel.run(code)[0] == "ok"
        status, error, _ = kernel.run(cells[slowest], interrupt_after=seconds[slowest] / 2)
        interrupted = status == "error" and error == "KeyboardInterrupt"
        failures = []
        for index in range(slowest, len(cells)):
            status, error, _ = kernel.run(cells[index])
            if status != "ok":
                failures.append(
                    f"cell {index + 1} ({cells[index].splitlines()[0][:60]!r}): {status}, {error}"
                )
        assert not failures, (
            f"after interrupting cell {slowest + 1} ({seconds[slowest]:.1f} s; the interrupt "
            f"{'landed' if interrupted else 'came too late'}) and running on from it:\n"
            + "\n".join(failures)
        )
    finally:
        kernel.close()


# torch.optim.Optimizer's constructor imports torch._dynamo the first time it runs (about a second's
# work). A Ctrl-C that lands in that import leaves a half-made module behind, and every later
# optimizer in that kernel fails ("partially initialized module 'torch._dynamo'"): lab 1 lost its
# kernel so once. What a notebook's first cell imports must leave no import to a later cell's
# optimizer: here an import that starts after them fails, as an interrupted one would.
OPTIMIZERS = {
    "torch.optim.AdamW": "from offloadlab.models import GPTConfig, TinyGPT\nfrom torch.optim "
    "import AdamW as make",
    "CPUOffloadAdam": "from offloadlab.models import GPTConfig, TinyGPT\nfrom offloadlab.offload "
    "import CPUOffloadAdam as make",
}
NO_MORE_IMPORTS = """
import sys
class Interrupted:
    def find_spec(self, name, path=None, target=None):
        raise KeyboardInterrupt(f"import of {name} after the first cell")
sys.meta_path.insert(0, Interrupted())
model = TinyGPT(GPTConfig(layers=1, hidden=32, heads=2, vocab=64, seq=8))
optimizer = make(model.parameters(), lr=1e-3)
model(torch.randint(0, 64, (2, 8)))[0].float().pow(2).mean().backward()
optimizer.step()
sys.meta_path.pop(0)
"""


@pytest.mark.parametrize("imports", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_the_first_optimizer_of_a_notebook_imports_nothing(imports):
    code = "import torch\n" + imports + NO_MORE_IMPORTS
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_cells_status_is_its_own_reply_not_an_earlier_one(tmp_path):
    """On a loaded machine jupyter_client's ``wait_for_ready`` asks for kernel_info more than
    once, and the spare replies wait on the shell channel: every cell then read the reply of the
    one before it, and a failing cell was reported as the next one's, without an error name
    ("cell 23 failed on the first run: None")."""
    kernel = Kernel(tmp_path)
    try:
        kernel.client.kernel_info()  # the spare request a slow start leaves behind
        assert kernel.run("1 / 0")[:2] == ("error", "ZeroDivisionError")
        assert kernel.run("pass")[:2] == ("ok", None)
    finally:
        kernel.close()
