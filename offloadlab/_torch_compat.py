"""Every private torch API offloadlab relies on, in one place, each tested on the torch it was
written for.

Parameter streaming and the optimizer need a few things torch has no public API for: whether a
backward pass is running and a callback at its end, whether ``torch.autograd.grad`` is capturing a
leaf's gradient, the saved-tensor hooks already in force, a module run with other tensors in place
of its parameters, autocast's cast node, tensors' version counters, GradScaler's hand-over to an
optimizer that scales its own gradients, and the optimizer's state-dict hooks. Each is reached
here and nowhere else, and each has a test on the pinned torch (``tests/test_torch_compat.py``).
A torch that lacks one raises :class:`MissingTorchAPI`, naming what is missing, the torch found
and the torch tested, the first time it is used (importing the package never fails for it). One
public API is here too, as older torches lack a keyword of it: ``torch.compiler.disable``'s
``reason`` (``tests/test_compile.py``).

Supported: torch :data:`SUPPORTED` (tested: :data:`TESTED`). Other versions install (the package
asks for torch ≥ 2.4, so that a GPU server's own CUDA build of torch is never replaced), and run
as far as these APIs are there.
"""

from __future__ import annotations

import functools
import importlib
import threading

import torch

__all__ = [
    "TESTED",
    "SUPPORTED",
    "MissingTorchAPI",
    "EndOfBackward",
    "in_backward",
    "issuing_backward",
    "grad_captures",
    "saved_tensors_default_hooks",
    "reparametrize_module",
    "is_cast_node",
    "version",
    "view_base",
    "storage_key",
    "WeakIdKeyDictionary",
    "FakeTensorMode",
    "disable_dynamo",
    "foreach_copy_",
    "dtensor_where_it_is",
    "accepts_grad_scaler",
    "grad_scaler_stepped",
    "optimizer_hooks",
    "eager_under_compile",
]

TESTED = "2.13.0"  # the torch CI pins, and every entry here is tested on
SUPPORTED = "2.13"  # the releases of torch offloadlab supports


# torch.optim loads two modules the first time they are needed: torch._dynamo when the first
# optimizer is made (a second's work) and the profiler's CUPTI monitor at the first step. A Ctrl-C
# that lands in such an import leaves a half-made module, and every later optimizer in that Python
# fails ("partially initialized module 'torch._dynamo'"): a notebook's kernel is lost. Loaded here,
# they load with the package, in the cell that imports torch.
for _lazy in ("torch._dynamo", "torch.profiler._cupti_monitor"):
    try:
        importlib.import_module(_lazy)
    except ImportError:  # (a torch without it: nothing to load early)
        pass


class MissingTorchAPI(RuntimeError):
    """A private torch API offloadlab uses is not in this torch."""

    def __init__(self, api: str, purpose: str):
        super().__init__(
            f"offloadlab needs torch's {api} ({purpose}), which torch {torch.__version__} does not "
            f"have; offloadlab supports torch {SUPPORTED} (tested: {TESTED})"
        )


def _find(path: str, purpose: str):
    """The object at dotted ``path`` ('torch._C._current_graph_task_id'), or a stand-in that raises
    :class:`MissingTorchAPI` when called."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for part in parts[split:]:
                found = getattr(found, part)
        except AttributeError:
            break
        return found

    def missing(*args, **kwargs):
        raise MissingTorchAPI(path, purpose)

    return missing


# ----------------------------------------------------------------------------- the autograd engine

_current_graph_task_id = _find("torch._C._current_graph_task_id", "which backward pass is running")
_queue_callback = _find(
    "torch.autograd.Variable._execution_engine.queue_callback",
    "a callback at the end of a backward pass",
)


_will_engine_execute_node = _find(
    "torch._C._will_engine_execute_node", "whether torch.autograd.grad captures a leaf's gradient"
)


def grad_captures(node) -> bool:
    """True inside ``torch.autograd.grad`` when it captures the gradient that ``node`` (a leaf's
    AccumulateGrad) would receive: torch refuses to say whether such a node runs there."""
    try:
        _will_engine_execute_node(node)
    except MissingTorchAPI:
        raise
    except RuntimeError as error:
        if "autograd.grad" in str(error):
            return True
        raise
    return False


def in_backward() -> bool:
    """True on a thread that is running a backward pass (a hook, or a block recomputed by
    checkpointing)."""
    return _current_graph_task_id() != -1


_closing = threading.local()  # .active: this thread runs an EndOfBackward at its pass's end


def issuing_backward() -> bool:
    """True inside a backward pass that may still issue work: not in the callbacks that close it,
    which run once autograd has issued everything (a host wait there stalls no backward kernel)."""
    return in_backward() and not getattr(_closing, "active", False)


class EndOfBackward:
    """Calls ``fn`` once at the end of every backward pass that :meth:`arm` was called in.

    A pass that raises never reaches its end: the next :meth:`arm` from another pass, or
    :meth:`settle` outside backward, calls ``fn`` for it then.
    """

    def __init__(self, fn):
        self._fn = fn
        self._armed: int | None = None  # the backward pass (graph task) whose end is awaited

    def arm(self) -> None:
        """From inside a backward pass: have its end call ``fn`` (once per pass)."""
        task = _current_graph_task_id()
        if self._armed is not None and self._armed != task:
            self._end()  # an earlier pass raised before its end: close it now
        if self._armed is None:
            _queue_callback(self._at_end)
            self._armed = task

    def settle(self) -> None:
        """Outside backward: call ``fn`` for a pass that raised before its end."""
        if self._armed is not None and not in_backward():
            self._end()

    @property
    def armed(self) -> bool:
        return self._armed is not None

    def _at_end(self) -> None:
        _closing.active = True
        try:
            self._end()
        finally:
            _closing.active = False

    def _end(self) -> None:
        self._armed = None
        self._fn()


_top_saved_tensors_default_hooks = _find(
    "torch._C._autograd._top_saved_tensors_default_hooks", "the saved-tensor hooks already in force"
)


def saved_tensors_default_hooks():
    """The (pack, unpack) saved-tensor hooks in force now (activation checkpointing's), or None."""
    return _top_saved_tensors_default_hooks(False)


# ``with reparametrize_module(module, {name: tensor}):`` runs ``module`` with those tensors in place
# of its parameters (torch.func.functional_call's machinery, without the call).
reparametrize_module = _find(
    "torch.nn.utils.stateless._reparametrize_module",
    "running a module with other tensors in place of its parameters",
)


@functools.cache
def _cast_node_type() -> type:
    """The autograd node of a dtype cast (``.to(dtype)``; autocast casts weights the same way)."""
    # (first asked inside a saved-tensor hook, where grad mode may be off)
    with torch.enable_grad():
        return type(torch.zeros(1, requires_grad=True).to(torch.float64).grad_fn)


def is_cast_node(node) -> bool:
    """True when ``node`` (a ``grad_fn``) is a dtype cast's, such as autocast's copy of a weight."""
    return type(node) is _cast_node_type()


# ----------------------------------------------------------------------------- tensors


def version(t: torch.Tensor) -> int:
    """``t``'s version counter: it moves on with every in-place change (autograd's own check)."""
    try:
        return t._version
    except AttributeError:
        raise MissingTorchAPI(
            "Tensor._version", "the version counter of in-place changes"
        ) from None


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, or None."""
    try:
        return t._base
    except AttributeError:
        raise MissingTorchAPI("Tensor._base", "the tensor a view was made from") from None


def storage_key(storage) -> int:
    """A key that is the same for every handle of one storage (its address may be 0: meta
    tensors)."""
    try:
        return storage._cdata
    except AttributeError:
        raise MissingTorchAPI("UntypedStorage._cdata", "telling storages apart") from None


WeakIdKeyDictionary = _find(
    "torch.utils.weak.WeakIdKeyDictionary",
    "a weak dictionary keyed by tensor identity (tensors compare elementwise)",
)

foreach_copy_ = _find("torch._foreach_copy_", "many device copies in one call")


def dtensor_where_it_is(local: torch.Tensor, like):
    """A DTensor over ``local`` placed as the DTensor ``like`` is (its mesh, placements, shape and
    stride), left on ``local``'s device: ``DTensor.from_local`` would copy a host tensor to the
    mesh's GPU. (FSDP2 builds its CPU-offloaded shards this way.)"""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        meta = TensorMeta(like.shape, like.stride(), local.dtype)
        spec = DTensorSpec(like.device_mesh, tuple(like.placements), tensor_meta=meta)
        return DTensor(local, spec, requires_grad=False)
    except (ImportError, TypeError, AttributeError):
        raise MissingTorchAPI(
            "torch.distributed.tensor._dtensor_spec.DTensorSpec",
            "a DTensor over host memory on a GPU mesh",
        ) from None


FakeTensorMode = _find(
    "torch._subclasses.fake_tensor.FakeTensorMode",
    "tensors with shapes and dtypes and no storage (a model's forward measured without memory)",
)


# ------------------------------------------------------------------------ torch.optim and torch.amp

disable_dynamo = _find(
    "torch._disable_dynamo", "keeping torch.compile out of state-dict methods, as torch.optim does"
)

_AMP_FLAG = "_step_supports_amp_scaling"


def accepts_grad_scaler(cls: type) -> type:
    """Class decorator: ``torch.amp.GradScaler.step(optimizer)`` then calls ``optimizer.step()``
    without reading ``.grad`` (which an offloading optimizer has emptied), having set the
    optimizer's ``found_inf`` and ``grad_scale``; :func:`grad_scaler_stepped` tells."""
    setattr(cls, _AMP_FLAG, True)
    return cls


def grad_scaler_stepped(optimizer) -> bool:
    """True (and GradScaler's two attributes removed) when this step() was called by
    GradScaler.step."""
    if "found_inf" not in optimizer.__dict__:
        return False
    optimizer.__dict__.pop("found_inf")
    optimizer.__dict__.pop("grad_scale", None)
    return True


_OPTIMIZER_HOOKS = {
    "state_dict_pre": "_optimizer_state_dict_pre_hooks",
    "state_dict_post": "_optimizer_state_dict_post_hooks",
    "load_state_dict_pre": "_optimizer_load_state_dict_pre_hooks",
    "load_state_dict_post": "_optimizer_load_state_dict_post_hooks",
}


def optimizer_hooks(optimizer, which: str) -> list:
    """The hooks registered on ``optimizer`` with ``register_<which>_hook`` (``which``:
    'state_dict_pre', 'state_dict_post', 'load_state_dict_pre', 'load_state_dict_post')."""
    attribute = _OPTIMIZER_HOOKS[which]
    try:
        return list(getattr(optimizer, attribute).values())
    except AttributeError:
        raise MissingTorchAPI(
            f"Optimizer.{attribute}", f"the optimizer's {which.replace('_', ' ')} hooks"
        ) from None


# ----------------------------------------------------------------------------- torch.compile


def eager_under_compile(reason: str, recursive: bool = True):
    """Decorator: under torch.compile the function runs eagerly, a graph break that gives
    ``reason`` where torch can; with ``recursive=False`` the functions it calls are still
    compiled."""
    try:
        return torch.compiler.disable(recursive=recursive, reason=reason)
    except TypeError:  # a torch whose disable() takes no reason
        return torch.compiler.disable(recursive=recursive)
