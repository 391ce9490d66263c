"""Importing offloadlab, and using its mechanisms, changes nothing in torch: every function and
class attribute torch had is still torch's own object afterwards.

Each check runs in a fresh interpreter, so that no other test's imports have run first."""

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

# The torch namespaces a patch would most likely touch: module-level functions and the methods of
# the classes users call (Module.zero_grad, clip_grad_norm_, Optimizer.step, Tensor methods, ...).
_SNAPSHOT = """
    import importlib, pathlib, sys, types
    import torch, torch.amp, torch.autograd.graph, torch.nn.utils.clip_grad, torch.utils.checkpoint
    # (torch wraps some of its own functions when it loads this, as any optimizer's use does)
    import torch._dynamo

    NAMESPACES = [torch, torch.nn, torch.nn.functional, torch.nn.utils, torch.nn.utils.clip_grad,
                  torch.nn.Module, torch.nn.Parameter, torch.Tensor, torch._C.TensorBase,
                  torch.optim, torch.optim.Optimizer, torch.optim.AdamW, torch.autograd,
                  torch.autograd.graph, torch.autograd.Function, torch.amp, torch.amp.GradScaler,
                  torch.cuda, torch.utils.checkpoint]

    def snapshot():
        return {(ns.__name__, name): value for ns in NAMESPACES for name, value in vars(ns).items()}

    def changes(before, after):
        changed = [key for key, value in before.items() if after.get(key, value) is not value]
        removed = [key for key in before if key not in after]
        added = [key for key, value in after.items()  # (not a submodule imported)
                 if key not in before and not isinstance(value, types.ModuleType)]
        return changed + removed + added
"""


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SNAPSHOT) + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_the_issues_one_liners_pass():
    for name in ("torch.nn.Module.zero_grad", "torch.nn.utils.clip_grad_norm_"):
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"import torch; f = {name}; import offloadlab.offload; assert {name} is f",
            ],
            cwd=ROOT,
            check=True,
            timeout=300,
        )


def test_importing_every_module_changes_nothing_in_torch():
    out = _run("""
        import offloadlab
        before = snapshot()
        root = pathlib.Path(offloadlab.__file__).parent
        # (every module but __main__, which runs the command)
        paths = [path for path in sorted(root.rglob("*.py")) if path.name != "__main__.py"]
        names = [".".join(("offloadlab", *path.relative_to(root).with_suffix("").parts))
                 .removesuffix(".__init__") for path in paths]
        for name in names:
            importlib.import_module(name)
        print(len(names), changes(before, snapshot()))
    """)
    count, changed = out.split(" ", 1)
    assert int(count) > 40 and changed.strip() == "[]", changed


def test_training_with_every_mechanism_changes_nothing_in_torch():
    """Building and using CPUOffloadAdam and StreamedModel (an emulated link) patches nothing
    either: what they change is the user's own objects (a streamed block's forward), never
    torch's."""
    out = _run("""
        from offloadlab.link import EmulatedLink
        from offloadlab.models import GPTConfig, TinyGPT
        from offloadlab.offload import CPUOffloadAdam
        from offloadlab.prefetch import Prefetcher
        from offloadlab.streaming import StreamedModel
        before = snapshot()
        config = GPTConfig(layers=2, hidden=32, heads=2, vocab=64, seq=16)
        tokens = torch.randint(0, 64, (2, 16))
        with EmulatedLink(bandwidth="8 GB/s", latency=0) as link:
            plain, streamed = TinyGPT(config), TinyGPT(config)
            StreamedModel(streamed, link)
            for model in (plain, streamed):
                optimizer = CPUOffloadAdam(model.parameters(), link=link, max_grad_norm=1.0)
                for _ in range(2):
                    optimizer.zero_grad()
                    model(tokens, tokens).backward()
                    optimizer.step()
                optimizer.close()
            for _ in Prefetcher([torch.ones(8), torch.ones(8)], link):
                pass
        print(changes(before, snapshot()))
    """)
    assert out.strip() == "[]", out
