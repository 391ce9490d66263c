"""Every graded check in every lab passes the worked answer and fails two plausible wrong ones.

Each lab runs once, as the student release's source notebook (so the checks are in the student
release and must not show expected values), in a real kernel on this machine's real (or
emulated) measurements. After each graded cell has passed with the worked answer, the test
runs each wrong answer below in the same kernel, runs the graded cell again and expects it to
fail; then it runs the answer cell again, so the rest of the lab sees the worked answer.

``WRONG`` lists, for every graded cell of a lab in order, two mistakes a student could make,
as code that replaces the answer. A lab with a graded cell missing here fails the test.

The graded cell with a hidden test (one per lab) gets a third: the expected value typed in as
a number, as a student who set ``OFFLOADLAB_STUDENT=0`` would read it. Its visible check must
pass (in this run the number is right) and its hidden test must fail it.
"""

import re

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from offloadlab_course.student import source_notebook
from tests.conftest import ROOT
from tests.kernels import UnixSocketKernelManager

# Lab 5's challenge: a prefetcher over uneven items with `count` buffers (the worked answer has
# three).
LAB05_AHEAD = """def my_ahead(items, link):  # {why}
    buffers = [link.device_buffer(max(item.numel() for item in items)) for _ in range({count})]
    released, transfers = [None] * {count}, {{}}
    for i in range(min({count}, len(items))):
        transfers[i] = link.to_device(buffers[i][: items[i].numel()], items[i], after=None)
    for i in range(len(items)):
        transfers.pop(i).wait()
        yield buffers[i % {count}][: items[i].numel()]
        released[i % {count}] = link.mark()
        if i + {count} < len(items):
            slot = buffers[i % {count}][: items[i + {count}].numel()]
            transfers[i + {count}] = link.to_device(slot, items[i + {count}],
                                                    after=released[i % {count}])"""

WRONG = {
    "lab01": [
        (
            "P * (4 + 4 + 4)",
            "fp32 AdamW without the gradients",
            "P * (4 + 4 + 4 + 4 + 4)",
            "fp32 AdamW with a master copy it does not keep",
        ),
        (
            "P * (4 + 4)",
            "SGD without its momentum",
            "P * (4 + 4 + 4 + 4)",
            "SGD with Adam's two moments",
        ),
        (
            "P * (2 + 2 + 4 + 4)",
            "fp32 moments on a bf16 model",
            "P * (2 + 2 + 4 + 4 + 4)",
            "the mixed-precision recipe",
        ),
        (
            "config.vocab * config.hidden + config.vocab",
            "a bias the head does not have",
            "2 * config.vocab * config.hidden",
            "both matrices counted as new",
        ),
        (
            "def my_trainer(model):  # 6 bytes a parameter after the step, 8 at its end\n"
            "    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
            "    def step():\n"
            "        optimizer.step()\n"
            "        optimizer.zero_grad(set_to_none=True)\n"
            "    return step, [optimizer]",
            "every gradient held until the step frees it",
            "def my_trainer(model):  # 4 bytes a parameter, but no moments: not AdamW\n"
            "    optimizers = {p: torch.optim.SGD([p], lr=1e-3) for p in model.parameters()}\n"
            "    def hook(p):\n"
            "        optimizers[p].step()\n"
            "        p.grad = None\n"
            "    for p in model.parameters():\n"
            "        p.register_post_accumulate_grad_hook(hook)\n"
            "    return (lambda: None), list(optimizers.values())",
            "SGD in backward",
        ),
    ],
    "lab02": [
        (
            "my_bandwidth = record.params['bytes_per_repeat'] * 8 / "
            "record.params['median_seconds']",
            "bits, not bytes",
            "my_bandwidth = record.params['bytes_per_repeat'] / record.params['median_seconds'] / "
            "2**30",
            "GiB/s",
        ),
        (
            "my_beta = 2e9",
            "the emulated link's default rate, copied instead of fitted",
            "my_beta = float(np.mean(sizes / times))",
            "the average of the measured rates",
        ),
        (
            "my_half_size = 20e-6 * 2e9",
            "the emulated link's default settings, copied",
            "my_half_size = fit.alpha * fit.beta / 2",
            "α set equal to twice n/β",
        ),
        (
            "def my_time(size):\n    return size / fit.beta",
            "α left out",
            "def my_time(size):\n    return 1.3 * (fit.alpha + size / fit.beta)",
            "30 % too long",
        ),
        (
            "my_exchange_seconds = exchange / h2d_both + exchange / d2h_both",
            "one direction after the other",
            "my_exchange_seconds = 3 * 2**30 / min(h2d_both, d2h_both)",
            "3 GiB instead of 3 GB",
        ),
        (
            "def my_probe(link):  # from pageable memory: the staging rate, not β\n"
            "    host, device = torch.empty(2**20), link.device_buffer(2**20)\n"
            "    seconds = sorted(link.to_device(device, host).elapsed for _ in range(5))\n"
            "    return 4 * 2**20 / seconds[2]",
            "pageable memory",
            "def my_probe(link):  # the sweep's answer, passed on: right here, wrong on any other "
            "link\n    return fit.beta",
            "known, not measured",
        ),
    ],
    "lab03": [
        (
            "predicted_batch = math.floor(t_transfer / seconds_per_sample)",
            "rounded down",
            "predicted_batch = math.ceil(seconds_per_sample / t_transfer)",
            "the ratio upside down",
        ),
        (
            "def predicted_step(b):\n    return b * seconds_per_sample + t_transfer",
            "no overlap",
            "def predicted_step(b):\n    return min(b * seconds_per_sample, t_transfer)",
            "the shorter of the two",
        ),
        (
            "measured_batch = max((b for b, r in zip(cross.batches, cross.results) if r.t_both > "
            "1.10 * r.t_compute),\n                     default=None)",
            "the last batch that still stalls",
            "measured_batch = predicted_batch",
            "the prediction, not the measurement",
        ),
        (
            "def my_step(link, work, host, device):  # the copy waited for before the work: they "
            "take turns\n    link.to_device(device, host).wait()\n"
            "    link.launch(work)",
            "one after the other",
            "def my_step(link, work, host, device):  # a copy ordered after nothing: it overwrites "
            "what is read\n    transfer = link.to_device(device, host, after=None)\n"
            "    link.launch(work)\n"
            "    transfer.wait()",
            "not after the buffer's last use",
        ),
    ],
    "lab04": [
        (
            "predicted_host = P * 12",
            "only the fp32 state",
            "predicted_host = P * (12 + w + (0 if low != torch.float32 else w))",
            "the outgoing buffer the wrong way round",
        ),
        (
            "plain_device = 12 * P",
            "plain AdamW without gradients",
            "offload_device = 2 * w * P",
            "gradients kept on the device",
        ),
        (
            "fraction = min(1.0, math.floor(100 * rate * window / (P * (k + 1) * w)) / 100)",
            "the two directions added, as if half duplex",
            "fraction = min(1.0, math.floor(100 * rate * window / (P * w)) / 100)",
            "one micro-batch's gradients counted",
        ),
        (
            "def my_offload(model, link):  # the whole budget in one bucket, but the optimizer "
            "keeps three\n    gradient_bytes = sum(p.numel() * p.element_size() for p in "
            "model.parameters())\n    return CPUOffloadAdam(model.parameters(), lr=1e-3, "
            "link=link, bucket_bytes=int(0.4 * gradient_bytes))",
            "one buffer counted",
            "def my_offload(model, link):  # small buckets: little device memory, a copy for "
            "almost every tensor\n    return CPUOffloadAdam(model.parameters(), lr=1e-3, "
            "link=link, bucket_bytes=64 * 2**10)",
            "too many copies",
        ),
    ],
    "lab05": [
        (
            "def my_prefetch(items, link):  # never waits for its copies\n"
            "    buffers = [link.device_buffer(items[0].numel()) for _ in range(2)]\n"
            "    for i, item in enumerate(items):\n"
            "        link.to_device(buffers[i % 2], item, after=None)\n"
            "        yield buffers[i % 2]",
            "no wait",
            "def my_prefetch(items, link):  # one buffer, refilled while the consumer still uses "
            "it\n    buffer = link.device_buffer(items[0].numel())\n"
            "    transfer = link.to_device(buffer, items[0], after=None)\n"
            "    for i in range(len(items)):\n"
            "        transfer.wait()\n"
            "        if i + 1 < len(items):\n"
            "            transfer = link.to_device(buffer, items[i + 1], after=None)\n"
            "        yield buffer",
            "one buffer, copied into while in use",
            "def my_prefetch(items, link):  # the host's tensors, never copied\n"
            "    yield from items",
            "nothing through the link",
            "def my_prefetch(items, link):  # the package's prefetcher\n"
            "    yield from Prefetcher(items, link)",
            "the package's Prefetcher",
        ),
        (
            "def my_prefetch(items, link):  # right data, but each copy starts when its item is "
            "asked for\n    buffer = link.device_buffer(items[0].numel())\n"
            "    for item in items:\n"
            "        link.to_device(buffer, item).wait()\n"
            "        yield buffer",
            "no prefetch",
            "def my_prefetch(items, link):  # two buffers, each copy issued after the consumer is "
            "done\n    buffers = [link.device_buffer(items[0].numel()) for _ in range(2)]\n"
            "    for i, item in enumerate(items):\n"
            "        link.to_device(buffers[i % 2], item, after=link.mark()).wait()\n"
            "        yield buffers[i % 2]",
            "two buffers, no prefetch",
        ),
        (
            "predicted_one_buffer = len(items) * max(copy_seconds, work_seconds)",
            "the double buffer's time",
            "predicted_one_buffer = copy_seconds + len(items) * work_seconds",
            "only the first copy exposed",
        ),
        (
            LAB05_AHEAD.format(
                count=2, why="a double buffer: the large copies have one item's work to hide behind"
            ),
            "a double buffer",
            LAB05_AHEAD.format(
                count=4, why="four buffers: ahead enough, but over the memory budget"
            ),
            "four buffers, over the budget",
        ),
    ],
    "lab06": [
        (
            "my_gpu_bytes = mixed.total * arch.params + activations",
            "nothing offloaded",
            "my_gpu_bytes = (mixed.weight_bytes + mixed.gradient_bytes) * arch.params",
            "the activations forgotten",
        ),
        (
            "my_step = max(6 * P * tokens_per_step / compute, (down_bytes + up_bytes) * P / both, "
            "P / cpu_rate)",
            "perfect overlap: the busiest resource alone",
            "my_step = 6 * P * tokens_per_step / compute + (down_bytes + up_bytes) * P / both + P "
            "/ cpu_rate",
            "nothing overlaps",
        ),
        (
            "my_tail = max(end for _, end, _ in lanes['D2H']) - end_of_backward",
            "until the last gradient landed",
            "my_tail = max(end for _, end, _ in lanes['H2D']) - min(start for start, _, _ in "
            "lanes['H2D'])",
            "the span of the uploads",
        ),
        (
            "my_up = up_bytes * 2 * P",
            "the plan's count: every parameter fetched twice",
            "my_up = up_bytes * (2 * L * block + root)",
            "no block kept from forward for backward",
        ),
        (
            "offload_extra = 2 * saved_bytes / beta",
            "the copies hide behind nothing",
            "offload_extra = max(0.0, saved_bytes / beta - forward_seconds)",
            "only the copy down counted",
        ),
        (
            "def my_stream(model, link, budget):  # the whole budget in weight buffers: the gather "
            "buffers left out\n    block = sum(p.numel() * p.element_size() for p in "
            "model.blocks[0].parameters())\n    return StreamedModel(model, link, buffers=budget "
            "// block)",
            "the gather buffers forgotten",
            "def my_stream(model, link, budget):  # the default two buffers: within the budget, "
            "more bytes up\n    return StreamedModel(model, link)",
            "fewer buffers than fit",
        ),
    ],
    "lab07": [
        (
            "my_footprint = 3 * 4 * n",
            "one version per file, nothing to fall back on",
            "my_footprint = 2 * 16 * n",
            "the gradients kept on disk too",
        ),
        (
            "my_disk_seconds = max(12 * n / read_rate, 12 * n / write_rate)",
            "reads and writes at the same time",
            "my_disk_seconds = 4 * n / read_rate + 4 * n / write_rate",
            "only the master weights",
        ),
        (
            "my_resume_step = max(master_steps)",
            "the newest step of the first file",
            "my_resume_step = min(exp_avg_sq_steps)",
            "the oldest step of the last file",
        ),
        (
            "def my_commit(state, data):  # the header first, one flush\n"
            "    idle = 1 - state.slot\n"
            "    state.write_header(idle, state.step + 1)\n"
            "    state.write_slot(idle, data)\n"
            "    state.flush()\n"
            "    state.step, state.slot = state.step + 1, idle",
            "the header written before the data it names",
            "def my_commit(state, data):  # one flush for data and header\n"
            "    idle = 1 - state.slot\n"
            "    state.write_slot(idle, data)\n"
            "    state.write_header(idle, state.step + 1)\n"
            "    state.flush()\n"
            "    state.step, state.slot = state.step + 1, idle",
            "no flush between the data and its header",
        ),
        (
            "my_block_bytes, my_queue_depth = 16 * 2**10, 1",
            "small requests, one at a time",
            "my_block_bytes, my_queue_depth = 4096, 16",
            "page-sized requests, many in flight",
        ),
    ],
    "lab08": [
        (
            "predicted_gather = 2 * 2 * P",
            "chapter 9b's 2wP, the root counted twice",
            "predicted_gather = 4 * (2 * config.layers * block + root)",
            "fp32 weights gathered",
        ),
        (
            "predicted_reduce = 4 * P",
            "fp32 gradients",
            "predicted_sent = predicted_reduce",
            "a rank sends the whole tensor",
        ),
        (
            "predicted_down, predicted_up = 2 * P, 2 * P",
            "bf16, but the model trains in fp32",
            "predicted_down, predicted_up = 4 * P, 12 * P",
            "the fp32 state sent up too",
        ),
        (
            "shard_down = 2 * P\nshard_up = 2 * P",
            "the whole model, not a rank's shard",
            "shard_down = 4 * P / N\nshard_up = 4 * P / N",
            "fp32, but the shards are bf16",
        ),
        (
            "def my_choice(tensor_bytes, ranks, down, up, interconnect, host_link, duplex):  # "
            "turns, always\n    sent = (ranks - 1) / ranks * tensor_bytes\n"
            "    return 'shard' if sent / interconnect <= (down + up) / host_link else 'offload'",
            "the host link's duplex ignored",
            "def my_choice(tensor_bytes, ranks, down, up, interconnect, host_link, duplex):  # "
            "bytes, not seconds\n    return 'shard' if (ranks - 1) / ranks * tensor_bytes <= down "
            "+ up else 'offload'",
            "the bytes compared, not their times",
        ),
    ],
}
# Lab 1's answers are plain expressions; name the variable each one replaces (the challenge's is
# code).
LAB01_ANSWERS = [
    "prediction_fp32_adam",
    "prediction_sgd",
    "prediction_bf16_adam",
    "prediction_extra_params",
    None,
]


# Each answer as a dishonest student copies it from the visible check's source: the package's
# function that computes the expected value, or the value itself, on the lab's own variables.
COPIED = {  # (each expression a student could copy from a check or the library)
    "prediction_fp32_adam": (
        'memory.state_bytes(P, "fp32-adam").total_bytes',
        'memory.get_recipe("fp32-adam").total * P',
    ),
    "my_bandwidth": ("record.value",),
    "measured_batch": ("cross.measured_batch",),
    "my_beta": ("probe.fit_alpha_beta(sizes, times).beta",),
    "predicted_batch": ("overlap.crossover_batch(nbytes, bandwidth, seconds_per_sample)",),
    "plain_device": (
        'memory.state_bytes(P, "fp32-adam").total_bytes',
        'memory.get_recipe("fp32-adam").total * P',
    ),
    "fraction": (
        'budget.verdict(rate, window, P, "optimizer", recipe=recipe, '
        "micro_batches=k).offload_fraction",
    ),
    "my_step": (
        "planner.plan(work, planner.Hardware(roomy, beta, compute=compute, "
        "cpu_adam=cpu_rate), duplex=both, recipe=recipe).chosen.step",
        "planner.single.schedule(work, planner.Hardware(roomy, beta, compute=compute, "
        'cpu_adam=cpu_rate), "optimizer", duplex=both, recipe=recipe).step',
        "overlap.offload_step(L, 2 * P / L * tokens_per_step / compute, 4 * P / L * "
        "tokens_per_step / compute, gradient=small_recipe.gradient_bytes * P / L / both, "
        "update=P / L / cpu_rate, upload=small_recipe.weight_bytes * P / L / both).step",
    ),
    "predicted_sent": ('sharding.ring_bytes("reduce-scatter", predicted_reduce, N)',),
    "offload_extra": (
        "overlap.activation_round_trip(saved_bytes, beta, forward_seconds, 2 * forward_seconds)",
    ),
}


def wrong_answers(lab: str):
    """[(code, description), (code, description)] for each graded cell of ``lab``, in order."""
    table = []
    for number, entry in enumerate(WRONG[lab]):
        mistakes = list(zip(entry[::2], entry[1::2]))  # (two, or more where a pass found more)
        if lab == "lab01" and LAB01_ANSWERS[number]:
            mistakes = [(f"{LAB01_ANSWERS[number]} = {code}", why) for code, why in mistakes]
        table.append(mistakes)
    return table


def graded(cell) -> bool:
    """A check the grader runs (reflections, graded by hand, are Markdown cells)."""
    return cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("grade", False)


def answer(cell) -> bool:
    return cell.metadata.get("nbgrader", {}).get("solution", False)


@pytest.mark.parametrize("path", sorted((ROOT / "labs").glob("lab*.md")), ids=lambda p: p.stem)
def test_every_check_passes_the_answer_and_fails_two_wrong_ones(path):
    lab = path.stem.split("_")[0]
    assert lab in WRONG, f"{path.name}: add two wrong answers for each of its graded cells to WRONG"
    notebook = source_notebook(path)
    mistakes = wrong_answers(lab)
    assert len(mistakes) == sum(graded(c) for c in notebook.cells), (
        f"{path.name}: WRONG must list two wrong answers for each graded cell"
    )
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        kernel_manager_class=UnixSocketKernelManager,
        resources={"metadata": {"path": str(path.parent)}},
    )
    failures, last_answer, checks, literals, tried = [], None, iter(mistakes), 0, set()
    with client.setup_kernel():
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type != "code":
                continue
            client.execute_cell(cell, index)  # the worked answer: every cell must pass
            if answer(cell):
                last_answer = cell
            if not graded(cell):
                continue
            for code, why in next(checks):
                client.execute_cell(nbformat.v4.new_code_cell(code), index)
                retry = nbformat.v4.new_code_cell(cell.source)
                try:
                    client.execute_cell(retry, index)
                    failures.append(
                        f"{cell.metadata.nbgrader.grade_id} passed a wrong answer: {why}"
                    )
                except CellExecutionError:
                    error = next(o for o in retry.outputs if o.output_type == "error")
                    shown = "".join(
                        o.get("text", "") for o in retry.outputs if o.output_type == "stream"
                    )
                    if error.ename != "AssertionError":
                        failures.append(
                            f"{cell.metadata.nbgrader.grade_id}, {why}: {error.ename}: "
                            f"{error.evalue}"
                        )
                    if "was expected" in shown:
                        failures.append(
                            f"{cell.metadata.nbgrader.grade_id} showed a student the answer: "
                            f"{shown}"
                        )
                client.execute_cell(last_answer, index)  # back to the worked answer
            hidden = re.search(r'grading\.recomputed\("(\w+)"', cell.source)
            # the answer typed in as the number this run expects: only the hidden test can tell
            if hidden:
                literals += 1
                name = hidden[1]
                shown = nbformat.v4.new_code_cell(
                    f"import os\nos.environ['OFFLOADLAB_STUDENT'] = '0'\nprint(repr({name}))"
                )
                client.execute_cell(shown, index)
                value = "".join(
                    o.get("text", "") for o in shown.outputs if o.output_type == "stream"
                ).strip()
                client.execute_cell(nbformat.v4.new_code_cell(f"{name} = {value}"), index)
                retry = nbformat.v4.new_code_cell(cell.source)
                try:
                    client.execute_cell(retry, index)
                    failures.append(
                        f"{cell.metadata.nbgrader.grade_id}: the hidden test passed {name} = "
                        f"{value}, typed in"
                    )
                except CellExecutionError:
                    error = next(o for o in retry.outputs if o.output_type == "error")
                    visible = "".join(
                        o.get("text", "") for o in retry.outputs if o.output_type == "stream"
                    )
                    if error.ename != "AssertionError" or "✓" not in visible:
                        failures.append(
                            f"{cell.metadata.nbgrader.grade_id}: a typed-in {name} should pass the "
                            f"visible check and fail the hidden one; got {error.ename}: "
                            f"{error.evalue}\n{visible}"
                        )
                client.execute_cell(
                    nbformat.v4.new_code_cell("os.environ['OFFLOADLAB_STUDENT'] = '1'"), index
                )
                client.execute_cell(last_answer, index)
            # the answer as the visible check's own expression: a function follows any input, so
            # only its refusal can tell; a value read off the lab's record does not follow another
            for name in re.findall(r'grading\.recomputed\("(\w+)"', cell.source):
                tried |= {name} & COPIED.keys()
                for copied in COPIED.get(name, ()):
                    client.execute_cell(nbformat.v4.new_code_cell(f"{name} = {copied}"), index)
                    retry = nbformat.v4.new_code_cell(cell.source)
                    try:
                        client.execute_cell(retry, index)
                        failures.append(
                            f"{cell.metadata.nbgrader.grade_id}: {name} = {copied} passed"
                        )
                    except CellExecutionError:
                        error = next(o for o in retry.outputs if o.output_type == "error")
                        shown = "".join(
                            o.get("text", "") for o in retry.outputs if o.output_type == "stream"
                        )
                        refused = "computes what the exercise asks" in error.evalue
                        if not (refused or error.ename == "AssertionError" and "✗" in shown):
                            failures.append(
                                f"{cell.metadata.nbgrader.grade_id}: {name} = {copied} should "
                                f"fail the hidden test; got {error.ename}: {error.evalue}"
                            )
                    client.execute_cell(last_answer, index)
    assert literals >= 1, f"{path.name}: expected a graded cell with a hidden test; found none"
    answered = {
        n for c in notebook.cells if answer(c) for n in re.findall(r"^(\w+) =", c.source, re.M)
    }
    untried = sorted(COPIED.keys() & answered - tried)
    assert not untried, f"{path.name}: no hidden test recomputes {untried}, copied from a check"
    assert not failures, "\n".join(failures)
