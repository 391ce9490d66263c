"""What the checks rely on, held as it was before any answer cell ran.

The answer-cell screen (guard.py) reads a cell without running it, so an alias it cannot follow
(``F = next(iter([check.Fraction]))`` in a function, a class passed as a parameter) can still
replace a function or class the checks call: ``Fraction.numerator``, ``torch.equal``, the
property of a library class an expected value is read from. A wrong answer would then pass.

Rather than follow every alias, the grader looks at the result: :func:`remember` notes what each
function, class and module the course relies on holds, and :func:`changed` names what differs.
A check that is about to pass asks :func:`why_not_checked` first, and fails instead when an
answer changed anything, naming it. ``remember`` runs before each cell with the modules' seal
(guard.py), from the first cell after the lab imports its checks; until then nothing is watched.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from types import MappingProxyType

__all__ = ["changed", "note", "remember", "standing_in", "why_not_checked"]

# The course's and the library's modules with all of their submodules, and the modules whose
# functions the checks call (the standard library's arithmetic, numpy, torch).
WATCHED_PACKAGES = ("offloadlab", "offloadlab_course")
WATCHED_MODULES = (
    "builtins", "collections", "decimal", "fractions", "functools", "genericpath", "math",
    "numbers", "numpy", "operator", "os", "pathlib", "posixpath", "random", "stat", "struct",
    "tempfile", "time", "torch", "torch.nn", "torch.nn.functional", "torch.optim", "types",
    "weakref", "zlib",
)  # fmt: skip
# What the kernel itself rebinds as it runs a cell (ipykernel's input, IPython's exit and quit).
KERNELS_OWN = MappingProxyType(
    {"builtins": frozenset({"display", "exit", "get_ipython", "input", "quit"})}
)

_MODULES: dict[str, tuple[types.ModuleType, dict]] = {}  # name: (module, what it held)
_CLASSES: dict[type, tuple[dict, dict]] = {}  # class: (what is watched, its whole namespace)
_NOTED: set[str] = set()  # what :func:`note` found changed, put back since or not
_STAND_INS: dict[int, object] = {}  # id: what the grader itself puts in place for a while


def remember(*_) -> None:
    """Note what every watched module and class loaded so far holds, those not noted before (an
    IPython ``pre_run_cell`` callback, beside the seal)."""
    for name, module in list(sys.modules.items()):
        watched = name in WATCHED_MODULES or name.split(".")[0] in WATCHED_PACKAGES
        if watched and isinstance(module, types.ModuleType) and name not in _MODULES:
            _MODULES[name] = (module, _relied_on(vars(module), skip=KERNELS_OWN.get(name, ())))
            for value in list(vars(module).values()):
                if isinstance(value, type):
                    for cls in value.__mro__:
                        if cls not in _CLASSES and not cls.__flags__ & _IMMUTABLE_TYPE:
                            _CLASSES[cls] = (_held_by(cls), dict(vars(cls)))


def changed() -> list[str]:
    """What an answer changed since it was noted, as ``module.name`` or ``Class.name``: a module's
    function, class or submodule rebound or deleted; a class's method or property, or any
    attribute of the course's and the library's own classes, set, added or deleted."""
    found = []
    for name, (module, held) in _MODULES.items():
        found += [f"{name}.{key}" for key in _differing(held, vars(module), added=False)]
    for cls, (held, whole) in _CLASSES.items():
        namespace = vars(cls)
        if len(namespace) == len(whole) and all(
            namespace.get(key, _GONE) is value for key, value in whole.items()
        ):
            continue  # (the quick look, a few milliseconds for all: note() runs often)
        now = _held_by(cls)
        inherited = {key: _inherited(cls, key) for key in now.keys() - held.keys()}
        found += [
            f"{cls.__module__}.{cls.__qualname__}.{key}"
            for key in _differing({**inherited, **held}, now)
        ]
    return sorted(found)


def note() -> None:
    """Keep what is changed now, for :func:`why_not_checked`, even if an answer puts it back
    later: a challenge notes after each call of an answer's function, since the grader runs
    between those calls with whatever the last one left."""
    _NOTED.update(changed())


@contextlib.contextmanager
def standing_in(values):
    """While the block runs, ``values`` (functions the grader puts in place of watched ones, as
    :func:`crashes.record` does ``os.fsync``'s) are not an answer's change."""
    values = list(values)
    _STAND_INS.update((id(value), value) for value in values)
    try:
        yield
    finally:
        for value in values:
            _STAND_INS.pop(id(value), None)


def why_not_checked() -> str:
    """'' while nothing is changed or noted; else the line a check that would pass gives
    instead."""
    changes = sorted(_NOTED.union(changed()))
    if not changes:
        return ""
    more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
    what = ", ".join(changes[:3]) + more
    return f"not checked: an answer cell changed {what}, which the checks rely on"


def _held_by(cls: type) -> dict:
    """What is watched of a class: all of the course's and the library's own classes hold, and
    the methods and descriptors of any other (whose data may be caches)."""
    ours = str(cls.__module__).split(".")[0] in WATCHED_PACKAGES
    return dict(vars(cls)) if ours else _relied_on(vars(cls))


def _inherited(cls: type, key: str):
    """What ``cls`` had under ``key`` from a base class (a key added to ``cls`` since is compared
    with it, as torch wraps an inherited ``step``); a sentinel if none had it."""
    return next((vars(base)[key] for base in cls.__mro__[1:] if key in vars(base)), _GONE)


def _differing(held: dict, now, added: bool = True) -> list[str]:
    """The keys whose values differ (deleted ones, and added ones with ``added``), but for a
    value torch wrapped around itself."""
    keys = held.keys() | now.keys() if added else held.keys()
    return [
        key
        for key in keys
        if now.get(key, _GONE) is not held.get(key, _GONE)
        and _STAND_INS.get(id(now.get(key, _GONE))) is not now.get(key, _GONE)
        and not _torchs_own_wrapper(held.get(key), now.get(key))
        and key not in CACHES
    ]


def _torchs_own_wrapper(before, now) -> bool:
    """Whether ``now`` is a wrapper torch put around ``before`` as it ran: torch.optim's profiling
    hook around an optimizer class's ``step`` (made with the class's first optimizer), or
    torch._dynamo's around ``torch.manual_seed`` (made when dynamo loads)."""
    code = getattr(now, "__code__", None)
    return (
        getattr(now, "__wrapped__", None) is before
        and code is not None
        and code.co_filename.startswith(_TORCH_FOLDER)
    )


def _relied_on(namespace, skip=()) -> dict:
    """The functions, classes, submodules and descriptors (a property) of a module's or a class's
    ``namespace``, but for the names in ``skip`` (its other values are data a library may rebind
    as it runs: caches, counters, flags)."""
    return {
        key: value
        for key, value in namespace.items()
        if (callable(value) or isinstance(value, types.ModuleType) or hasattr(value, "__get__"))
        and key not in skip
    }


_GONE = object()  # what a deleted name holds
# A class Python itself refuses to change (the built-in and extension types): not watched.
_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE
# What Python itself adds to a class as a cache (copyreg, when an instance is first pickled).
CACHES = frozenset({"__slotnames__"})
_TORCH_FOLDER = os.path.dirname(importlib.util.find_spec("torch").origin) + os.sep
