"""The package's map of its layers (offloadlab.LAYERS) holds: every module is in a layer, and each
imports only modules of its own layer or of the layers below — at import time and inside
functions alike. The two lowest layers import nothing outside the standard library when they are
imported (they also run in Pyodide), offload and streaming do not import each other, and no
modules import each other in a circle when they are imported."""

import ast
import sys
from pathlib import Path

import pytest

import offloadlab

ROOT = Path(offloadlab.__file__).parent
LAYERS = list(offloadlab.LAYERS)  # top first
PURE = LAYERS[-2:]  # estimates and base


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def layer_of(name: str) -> int | None:
    """The index of ``name``'s layer in LAYERS (0 is the top), or None."""
    for index, members in enumerate(offloadlab.LAYERS.values()):
        if any(name == f"offloadlab.{m}" or name.startswith(f"offloadlab.{m}.") for m in members):
            return index
    return None


def imports(name: str, source: str | None = None) -> list[tuple[str, bool, int]]:
    """(imported module, at import time?, line) of every import in module ``name`` (or in
    ``source``, as if it were that module's)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source)
    top = {id(node) for node in tree.body}
    top |= {
        id(n) for node in tree.body if isinstance(node, (ast.If, ast.Try)) for n in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            # `from . import x`: the modules
            if node.module is None or (module in offloadlab_packages()):
                found += [
                    (
                        f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module,
                        id(node) in top,
                        node.lineno,
                    )
                    for alias in node.names
                ]
            else:
                found.append((module, id(node) in top, node.lineno))
    return found


def is_ours(imported: str) -> bool:
    """True for offloadlab and its modules (not offloadlab_course, the course's package)."""
    return imported == "offloadlab" or imported.startswith("offloadlab.")


def offloadlab_packages() -> set[str]:
    return {name for name, path in MODULES.items() if path.name == "__init__.py"}


def own(imported: str) -> str | None:
    """The offloadlab module an import names (a name inside a module: that module), or None."""
    while imported and imported not in MODULES:
        imported = imported.rpartition(".")[0]
    return imported or None


def test_every_module_is_in_exactly_one_layer():
    unplaced = [name for name in MODULES if name != "offloadlab" and layer_of(name) is None]
    assert unplaced == [], f"place these in offloadlab.LAYERS: {unplaced}"
    named = [m for members in offloadlab.LAYERS.values() for m in members]
    assert len(named) == len(set(named))
    assert all(own(f"offloadlab.{m}") == f"offloadlab.{m}" for m in named), (
        "LAYERS names a module that is gone"
    )


@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_module_imports_only_its_own_layer_and_those_below(name):
    if name == "offloadlab":
        return
    layer = layer_of(name)
    above = [
        (imported, line)
        for imported, _, line in imports(name)
        if is_ours(imported)
        and (target := own(imported)) != "offloadlab"
        and layer_of(target) < layer
    ]
    assert above == [], f"{name} ({LAYERS[layer]}) imports from layers above it: {above}"


@pytest.mark.parametrize(
    "name", [n for n in sorted(MODULES) if layer_of(n) is not None and LAYERS[layer_of(n)] in PURE]
)
def test_the_pure_layers_import_only_the_standard_library(name):
    outside = [
        (imported, line)
        for imported, at_import, line in imports(name)
        if at_import
        and not is_ours(imported)
        and imported.split(".")[0] not in sys.stdlib_module_names
        and imported != "__future__"
    ]
    assert outside == [], (
        f"{name} imports, when it is imported, more than the standard library: {outside}"
    )


def test_the_library_never_imports_the_course():
    """The course's package (course/offloadlab_course) imports the library, never the reverse
    (the GPU kit, which asks it for lab 4's cap, runs from the checkout: tools/gpu_check.py)."""
    importing = {
        name
        for name in MODULES
        for imported, _, _ in imports(name)
        if imported.split(".")[0] == "offloadlab_course"
    }
    assert importing == set()


def test_offload_and_streaming_do_not_import_each_other():
    offload = [
        n for n in MODULES if n == "offloadlab.offload" or n.startswith("offloadlab.offload.")
    ]
    for name in offload:
        assert not any(own(i) == "offloadlab.streaming" for i, _, _ in imports(name)), name
    assert not any(
        (own(i) or "").startswith("offloadlab.offload")
        for i, _, _ in imports("offloadlab.streaming")
    )


def test_no_modules_import_each_other_in_a_circle_at_import_time():
    graph = {
        name: {own(i) for i, at_import, _ in imports(name) if at_import and is_ours(i)} - {None}
        for name in MODULES
    }
    # a package's modules import their package's __init__ first: not a circle of theirs
    for name in graph:
        graph[name] -= {p for p in offloadlab_packages() if name.startswith(p + ".")}
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError(" -> ".join(path[path.index(name) :] + [name]))
        if name in done:
            return
        path.append(name)
        for target in sorted(graph[name]):
            visit(target)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_checks_see_what_they_look_for():
    """streaming as it was before issue 23: a late import of offload inside a method."""
    before = (
        "from .gather import GradientGather\n\ndef check():\n    from .offload import managed\n"
    )
    found = imports("offloadlab.streaming", before)
    assert ("offloadlab.gather", True, 1) in found and ("offloadlab.offload", False, 4) in found
    assert (
        layer_of("offloadlab.link.cuda")
        == layer_of("offloadlab.link")
        > layer_of("offloadlab.offload")
    )
    assert own("offloadlab.nvme.tier.FileTier") == "offloadlab.nvme.tier"
    assert ("offloadlab.units", True, 1) in imports("offloadlab.memory", "from . import units\n")
    assert ("torch", False, 2) in imports("offloadlab.memory", "def f():\n    import torch\n")
