"""Each private torch API offloadlab uses (offloadlab/_torch_compat.py) does, on the pinned
torch, what the package relies on; a torch without one gets an error naming the torch found and
the one tested; and no other module of the package reaches into torch's private parts."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from offloadlab import _torch_compat as compat

PACKAGE = Path(compat.__file__).parent


def test_the_tested_torch_is_the_pinned_one_and_the_supported_range_holds_it():
    assert torch.__version__.split("+")[0] == compat.TESTED
    stated = f"torch {compat.SUPPORTED} (tested: {compat.TESTED})"
    for name in ("pyproject.toml", "README.md"):
        assert stated in (PACKAGE.parent / name).read_text(encoding="utf-8"), (
            f"{name} states the torch supported"
        )


def test_in_backward_and_the_end_of_backward_callback():
    seen, ends = [], []
    # at the end: still inside the pass, no longer issuing its work
    end = compat.EndOfBackward(
        lambda: ends.append((len(seen), compat.in_backward(), compat.issuing_backward()))
    )
    w = torch.ones(3, requires_grad=True)
    # armed twice: one call
    w.register_hook(
        lambda g: (
            seen.append((compat.in_backward(), compat.issuing_backward())),
            end.arm(),
            end.arm(),
        )[-1]
    )
    assert not compat.in_backward() and not compat.issuing_backward()
    (w * 2).sum().backward()
    assert seen == [(True, True)] and ends == [(1, True, False)] and not end.armed
    assert not compat.issuing_backward()  # (the flag does not outlive the callback)


def test_a_backward_that_raised_is_ended_by_settle_or_the_next_pass():
    ends = []
    end = compat.EndOfBackward(lambda: ends.append(1))
    w = torch.ones(3, requires_grad=True)
    hook = w.register_hook(
        lambda g: (end.arm(), (_ for _ in ()).throw(ArithmeticError("in backward")))
    )
    with pytest.raises(ArithmeticError):
        (w * 2).sum().backward()
    assert ends == [] and end.armed  # its end never came
    end.settle()
    assert ends == [1] and not end.armed
    with pytest.raises(ArithmeticError):
        (w * 2).sum().backward()
    hook.remove()
    w.register_hook(lambda g: end.arm())
    (w * 2).sum().backward()  # a new pass closes the one that raised, then ends itself
    assert ends == [1, 1, 1]


def test_autograd_grad_capturing_a_leafs_gradient_is_told_from_backward():
    seen = []

    class Fetch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, leaf, copy):
            return copy

        @staticmethod
        def backward(ctx, grad):
            seen.append(compat.grad_captures(ctx.next_functions[0][0]))
            return None, None

    w, other = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    for run in (
        lambda y: y.backward(),
        lambda y: y.backward(inputs=[w]),
        lambda y: torch.autograd.grad(y, [w], allow_unused=True),
    ):
        run((Fetch.apply(w, w.detach() * 2) * other).sum())
    assert seen == [False, False, True]


def test_the_saved_tensor_hooks_in_force_are_found():
    assert compat.saved_tensors_default_hooks() is None
    pack, unpack = (lambda t: t), (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert compat.saved_tensors_default_hooks() == (pack, unpack)


def test_a_module_runs_with_other_tensors_in_place_of_its_parameters():
    layer = nn.Linear(2, 2, bias=False)
    with compat.reparametrize_module(layer, {"weight": torch.eye(2)}):
        assert torch.equal(layer(torch.tensor([[1.0, 2.0]])), torch.tensor([[1.0, 2.0]]))
    assert isinstance(layer.weight, nn.Parameter)


def test_autocasts_copy_of_a_weight_is_a_cast_node_and_other_nodes_are_not():
    layer = nn.Linear(4, 4)
    casts = []

    def pack(t):
        # (the weight is saved transposed)
        source = t if compat.view_base(t) is None else compat.view_base(t)
        casts.append(source.grad_fn is not None and compat.is_cast_node(source.grad_fn))
        return t

    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        layer(torch.randn(2, 4, requires_grad=True))
    assert any(casts), "autocast's bf16 copy of the weight is saved, and recognised"
    assert not compat.is_cast_node((torch.ones(2, requires_grad=True) * 2).grad_fn)


def test_version_counters_view_bases_and_storage_keys():
    t = torch.zeros(4)
    before = compat.version(t)
    t.add_(1)
    assert compat.version(t) == before + 1
    view = t[1:]
    assert compat.view_base(view) is t and compat.view_base(t) is None
    assert compat.storage_key(view.untyped_storage()) == compat.storage_key(t.untyped_storage())
    assert compat.storage_key(torch.zeros(4).untyped_storage()) != compat.storage_key(
        t.untyped_storage()
    )


def test_the_weak_identity_dictionary_keys_tensors_by_identity():
    a, b = torch.zeros(2), torch.zeros(2)  # equal values, two tensors
    table = compat.WeakIdKeyDictionary()
    table[a], table[b] = "a", "b"
    assert (table[a], table[b], len(table)) == ("a", "b", 2)
    del a
    assert len(table) == 1


def test_foreach_copy_and_disable_dynamo():
    targets, sources = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.full((3,), 2.0)]
    compat.foreach_copy_(targets, sources)
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))
    assert compat.disable_dynamo(lambda: 7)() == 7


def test_grad_scaler_hands_over_to_an_optimizer_that_accepts_it():
    class Refused(Exception):
        pass

    @compat.accepts_grad_scaler
    class Refusing(torch.optim.SGD):  # as CPUOffloadAdam: refuse the scaler, step on its own
        def step(self, closure=None):
            if compat.grad_scaler_stepped(self):
                raise Refused
            self.stepped = True

    w = nn.Parameter(torch.ones(2))
    optimizer = Refusing([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(w.sum()).backward()
    with pytest.raises(Refused):
        scaler.step(optimizer)
    assert "found_inf" not in optimizer.__dict__ and "grad_scale" not in optimizer.__dict__
    optimizer.step()
    assert optimizer.stepped


def test_the_optimizers_state_dict_hooks_are_read():
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    hooks = {
        which: (lambda *a: None)
        for which in (
            "state_dict_pre",
            "state_dict_post",
            "load_state_dict_pre",
            "load_state_dict_post",
        )
    }
    for which, hook in hooks.items():
        getattr(optimizer, f"register_{which}_hook")(hook)
        assert compat.optimizer_hooks(optimizer, which) == [hook]


@pytest.mark.parametrize(
    "use",
    [
        lambda: compat._find("torch._C._no_such_internal", "testing")(),
        lambda: compat.version(object()),
        lambda: compat.view_base(object()),
        lambda: compat.storage_key(object()),
        lambda: compat.optimizer_hooks(object(), "state_dict_pre"),
    ],
)
def test_a_missing_api_names_itself_and_the_torch_versions(use):
    with pytest.raises(
        compat.MissingTorchAPI,
        match=rf"torch {re.escape(torch.__version__)} does not have; "
        rf"offloadlab supports torch .*\(tested: {compat.TESTED}\)",
    ):
        use()


def test_the_module_finds_every_api_it_names_on_this_torch():
    for name in (
        "_current_graph_task_id",
        "_will_engine_execute_node",
        "_queue_callback",
        "_top_saved_tensors_default_hooks",
        "reparametrize_module",
        "WeakIdKeyDictionary",
        "FakeTensorMode",
        "foreach_copy_",
        "disable_dynamo",
    ):
        assert getattr(getattr(compat, name), "__name__", "") != "missing", name


# What a reach into torch's private parts looks like in the source (names and attributes).
_PRIVATE = re.compile(
    r"torch\._(?!_version__)|\._version\b|\._base\b|\._cdata\b|_reparametrize_module|queue_callback|"
    r"_execution_engine|ToCopyBackward|found_inf|_step_supports_amp_scaling|WeakIdKeyDictionary|"
    r"_optimizer_(load_)?state_dict_(pre|post)_hooks|_top_saved_tensors|_current_graph_task_id|"
    r"_will_engine_execute_node"
)


def test_no_other_module_uses_a_private_torch_api():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_torch_compat.py":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if _PRIVATE.search(code) and "_torch_compat." not in code:
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert offenders == [], "\n".join(offenders)
