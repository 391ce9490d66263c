"""The from-scratch cores the chapters build, run from the chapters' own cells and held to the
package in the unit tier: chapter 6's OffloadAdamW (bit for bit with CPUOffloadAdam on a CPU),
chapter 7's double buffer (the same items, copies in the same order, each slot refilled only
after its reader, as Prefetcher) and lab 7's TwoSlotFile with its worked commit (the step
committed last, whole, as FileTier holds it; a torn header falls back to the step before). The
notebooks check the same inside hidden cells; these tests need no kernel."""

import ast
import importlib.util
import os

import jupytext
import torch

from offloadlab.link import EmulatedLink
from offloadlab.models import GPTConfig, TinyGPT, batches, markov_corpus, train
from offloadlab.nvme import FileTier
from offloadlab.offload import CPUOffloadAdam
from offloadlab.prefetch import Prefetcher
from tests.conftest import ROOT


def code_cells(chapter: str) -> list[str]:
    notebook = jupytext.read(ROOT / "book" / chapter)
    return [cell.source for cell in notebook.cells if cell.cell_type == "code"]


def chapter_core(chapter: str, names: set[str]) -> dict:
    """A namespace holding what ``chapter`` defines under ``names``: its first cell (the imports)
    run, then, from each later cell that defines one of ``names`` or adds a method to one
    (``@add_to(Name)``), its definitions alone (the cell's other statements are the chapter's
    experiments, not the core)."""
    cells = code_cells(chapter)
    namespace: dict = {}
    exec(compile(cells[0], f"{chapter}, cell 1", "exec"), namespace)
    for number, source in enumerate(cells[1:], 2):
        definitions = [
            node
            for node in ast.parse(source).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))
        ]
        extended = {
            decorator.args[0].id
            for node in definitions
            for decorator in node.decorator_list
            if isinstance(decorator, ast.Call)
            and getattr(decorator.func, "id", None) == "add_to"
            and decorator.args
            and isinstance(decorator.args[0], ast.Name)
        }
        if ({node.name for node in definitions} | extended) & names:
            module = ast.Module(body=definitions, type_ignores=[])
            exec(compile(module, f"{chapter}, cell {number}", "exec"), namespace)
    missing = names - namespace.keys()
    assert not missing, f"{chapter} no longer defines {sorted(missing)}"
    return namespace


def test_chapter_6s_offload_adamw_is_cpu_offload_adam_bit_for_bit():
    core = chapter_core("06_cpu_adam.md", {"add_to", "OffloadAdamW"})
    config = GPTConfig(layers=2, hidden=64, heads=4, vocab=128, seq=32)
    corpus = markov_corpus(config.vocab, 20_000)

    def fresh_model():
        torch.manual_seed(0)
        return TinyGPT(config)

    ours_model, package_model = fresh_model(), fresh_model()
    with EmulatedLink(bandwidth="8 GB/s", latency=0) as link:
        ours = core["OffloadAdamW"](ours_model.parameters(), link)
        package = CPUOffloadAdam(package_model.parameters(), lr=1e-3, bucket_bytes=16 * 2**10)
        runs = {"ours": (ours_model, ours), "package": (package_model, package)}
        data = {name: batches(corpus, 4, config.seq) for name in runs}  # the same batches
        for _ in range(3):
            for name, (model, optimizer) in runs.items():
                train(model, optimizer, data[name], 1, "cpu")
        ours.close()
        package.close()
    for a, b in zip(ours_model.parameters(), package_model.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(next(ours_model.parameters()), next(fresh_model().parameters()))


def test_chapter_7s_double_buffer_fetches_as_prefetcher_does():
    core = chapter_core("07_prefetch.md", {"double_buffer"})
    with EmulatedLink(bandwidth="2 GB/s", latency=0) as link:
        weights = [link.host_buffer(2**16).normal_() for _ in range(6)]
        expected = torch.stack([w.sum() for w in weights])

        def consume(iterator):
            """Sum each item on the compute stream; (sums, copies, computes) on the link's
            clock."""
            sums, computes = torch.zeros(len(weights)), []
            with link.record() as recording:
                for i, tensor in enumerate(iterator):
                    begin = link.mark()
                    link.launch(lambda t=tensor, i=i: sums[i].copy_(t.sum()))
                    computes.append((begin, link.mark()))
            link.synchronize()
            copies = [(t.start, t.end, t.label) for t in recording.transfers]
            return sums, copies, [(b.time, e.time) for b, e in computes]

        ours = consume(core["double_buffer"](weights, link))
        package = consume(Prefetcher(weights, link))
    for sums, copies, computes in (ours, package):
        assert torch.equal(sums, expected)  # every item intact, none read early
        # a slot is refilled only once its last reader is done
        assert all(copies[i + 2][0] >= computes[i][1] for i in range(len(weights) - 2))
    assert [label for _, _, label in ours[1]] == [str(i) for i in range(len(weights))]
    assert len(ours[1]) == len(package[1]) == len(weights)


LAB_07 = "labs/lab07_one_tier_further.md"


def two_slot_module(folder):
    """Lab 7's TwoSlotFile as the lab writes it (its %%writefile cell), imported, with the lab's
    worked commit added as ``my_commit``."""
    cells = code_cells(LAB_07)
    parts = [source for source in cells if "two_slot.py" in source.split("\n")[0]]
    assert parts and parts[0].startswith("%%writefile "), "lab 7 no longer writes two_slot.py"
    commit = next(source for source in cells if source.startswith("def my_commit("))
    path = folder / "two_slot.py"
    path.write_text("".join(part.split("\n", 1)[1] + "\n" for part in parts), encoding="utf-8")
    with path.open("a", encoding="utf-8") as file:
        file.write("\n" + "\n".join(line for line in commit.splitlines() if "###" not in line))
    spec = importlib.util.spec_from_file_location("two_slot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lab_7s_two_slot_file_keeps_the_last_step_whole_as_file_tier_does(tmp_path):
    two_slot = two_slot_module(tmp_path)
    n = 4096
    ours = two_slot.TwoSlotFile(tmp_path / "ours.bin", 4 * n)
    tier = FileTier(tmp_path / "tier.bin", n)
    for step in range(3):
        values = torch.full((n,), float(step))
        two_slot.my_commit(ours, values.numpy())
        tier.write(0, values)
        tier.commit()
    held = torch.frombuffer(ours.read(), dtype=torch.float32)
    in_tier = torch.empty(n)
    tier.read(0, in_tier)
    assert (
        ours.step == 2 and torch.equal(held, in_tier) and torch.equal(held, torch.full((n,), 2.0))
    )
    ours.close()
    tier.close()
    # a crash while the newest header was written: its checksum fails, the step before stands
    fd = os.open(tmp_path / "ours.bin", os.O_RDWR)
    try:
        os.pwrite(fd, b"\xff" * 4, ours.slot * two_slot.PAGE)
    finally:
        os.close(fd)
    reopened = two_slot.TwoSlotFile(tmp_path / "ours.bin", 4 * n)
    older = torch.frombuffer(reopened.read(), dtype=torch.float32)
    assert reopened.step == 1 and torch.equal(older, torch.full((n,), 1.0))
    reopened.close()
