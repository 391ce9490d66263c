"""What keeps a lab's grade out of the reach of its answer cells.

nbgrader runs a submission's answer cells and the checks in one Python process, so an answer
cell could change the checks instead of answering: ``check.answer = lambda *a, **k: True``.
Three guards, one before the kernel runs and two inside it:

- :class:`ScreenAnswers`, an nbgrader preprocessor that ``nbgrader autograde`` runs before the
  notebook executes (course/nbgrader_config.py names it): each answer cell is read, not run, and
  one that rebinds a name the lab's own cells bind (the checks, ``grading``, the measurements),
  changes an attribute or an item outside the functions it defines, reaches a private or special
  attribute, imports what an answer does not need, or calls Python's ways around all that
  (``setattr``, ``exec``, ``vars``…) is replaced by a cell that raises and says why;
- :func:`seal_course_modules`, run in the kernel before each cell once the labs' checks are
  imported: the course's and the library's modules refuse new attributes, so an alias the
  screen cannot follow (``c = check; c.answer = …`` inside a function) fails when it runs;
- :mod:`offloadlab_course.watch`, beside the seal: what the checks rely on outside the sealed
  modules (``fractions.Fraction``, ``torch.equal``, the library's classes) is noted before the
  answers run, and a check that would pass after an answer changed any of it fails instead.

None is a sandbox: Python in a kernel can reach anything in it. They close every route the
course's tests try (tests/test_guard.py), and the screen's and the watch's messages name what
they stopped in the feedback.

:class:`ClearTracebacks` is for feedback: a failed check's traceback lists the lines of its cell,
hidden tests included, so feedback keeps each error's type and message only.
"""

from __future__ import annotations

import ast
import re
import sys
import types

from nbconvert.preprocessors import Preprocessor
from traitlets import Bool

from offloadlab_course.check import ReadOnlyClass, sealed

__all__ = ["ClearTracebacks", "ScreenAnswers", "screen", "seal_course_modules", "untimed"]

# Modules an answer may import: arithmetic, the standard containers, tensors and the library.
IMPORTABLE = frozenset({
    "bisect", "collections", "dataclasses", "functools", "heapq", "itertools", "math", "numpy",
    "offloadlab", "operator", "random", "statistics", "time", "torch", "typing",
})  # fmt: skip
# Python's ways to reach or change a name without writing it, as a name or as an attribute
# (``dataclasses.builtins.exec``, ``operator.attrgetter("__dict__")``).
REFUSED_NAMES = frozenset({
    "__builtins__", "__import__", "attrgetter", "breakpoint", "builtins", "compile", "delattr",
    "eval", "exec", "get_ipython", "getattr", "globals", "locals", "methodcaller",
    "setattr", "sys", "vars",
    # a property's getter, or a base class's, reads what a subclass hides (lab 2's hidden rate)
    "fdel", "fget", "fset", "super",
    # frames: a generator's, a coroutine's or a traceback's lead to the grader's local variables
    "ag_frame", "cr_frame", "f_back", "f_builtins", "f_globals", "f_locals", "gi_frame",
    "tb_frame", "tb_next",
    # inspect (reachable as another module's attribute: dataclasses.inspect) reads anything
    "inspect",
    # files: the course's sources, solutions included, may sit on the grading machine
    "fromfile", "genfromtxt", "load", "loadtxt", "memmap", "open", "read_bytes", "read_text",
    # a format field looks attributes up by name: '{0._bandwidth}'.format(link)
    "format", "format_map", "Formatter", "get_field", "vformat",
    "from_file", "FileIO", "mmap",
    # the environment (the release's switch) and the processes and modules it can start
    "environ", "environb", "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp",
    "execvpe", "fork", "forkpty", "import_module", "importlib", "popen", "posix_spawn",
    "posix_spawnp", "putenv", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve",
    "spawnvp", "spawnvpe", "subprocess", "system", "unsetenv",
    # what runs code out of the grader's sight: pickled calls, C calls, threads left running, and
    # the hooks a hidden test's notes of the answer's calls rest on
    "ctypes", "loads", "marshal", "pickle", "_thread", "threading", "Thread", "getprofile",
    "gettrace", "setprofile", "settrace", "concurrent", "futures", "ProcessPoolExecutor",
    "start_new_thread", "ThreadPoolExecutor", "Timer",
    # classes made from a namespace (special methods named by a built string), and more ways
    # out to files, processes and native code
    "make_dataclass", "cpp_extension", "ctypeslib", "download_url_to_file", "fdopen",
    "fromregex", "kill", "load_library", "unlink",
})  # fmt: skip
# Methods that change a list, dict or set in place: refused on what the lab's cells bind
# (clearing the lab's own measurements answers its check).
CHANGING_METHODS = frozenset({
    "add", "append", "clear", "discard", "extend", "insert", "pop", "popitem", "remove",
    "reverse", "setdefault", "sort", "update",
})  # fmt: skip
SEALED_PACKAGES = ("offloadlab", "offloadlab_course")
# The special methods an answer's own class may define: making and showing an instance.
ALLOWED_SPECIAL_METHODS = frozenset({"__init__", "__repr__", "__str__"})


def screen(source: str, protected: set[str], imports=frozenset()) -> list[str]:
    """Why the answer cell ``source`` may not run, one phrase per reason (none for a plain
    answer). ``protected``: the names the lab's own cells bind; ``imports``: the lab's imports,
    as (module, name, bound as), which an answer may repeat (``import numpy as np``)."""
    try:
        tree = ast.parse(_python(untimed(source)))
    except SyntaxError:
        return []  # it fails when it runs, as it would have anyway
    reasons = []
    top = _owned(_NO_ARGUMENTS, tree.body) - protected
    _Screen(protected, reasons, top, frozenset(imports)).visit(tree)
    return list(dict.fromkeys(reasons))


def untimed(source: str) -> str:
    """The cell without a ``%%time`` above it or a ``%time`` before a statement: IPython runs
    what they time as it stands, so the screen reads that, not a call it cannot see into."""
    lines = source.split("\n")
    if lines[0].strip() == "%%time":
        lines = lines[1:]
    return "\n".join(re.sub(r"^(\s*)%time\s+", r"\1", line) for line in lines)


def _python(source: str) -> str:
    """The cell as the kernel runs it: IPython's ``%magics`` turned into calls."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


class _Screen(ast.NodeVisitor):
    """Walks one answer cell; ``local`` holds the names a function being walked owns (its
    parameters, and names it assigns from anything but another name), ``top`` those the cell
    owns at its top level (names it binds only to values it builds)."""

    def __init__(self, protected: set[str], reasons: list[str], top: set[str], imports):
        self.protected, self.reasons, self.local, self.top = protected, reasons, None, top
        self.imports = imports  # (the lab's own, which bind the same objects again)
        self.comprehended: set[str] = set()
        self.called: set[int] = set()  # the changing methods visit_Call has named

    def visit_Import(self, node):
        for alias in node.names:
            if _import_of(None, alias) not in self.imports:  # (the lab's own: the same object)
                self._importing(alias.name)
                self._binding((alias.asname or alias.name).split(".")[0])

    def visit_ImportFrom(self, node):
        for alias in node.names:
            if alias.name == "*":  # (names it cannot see: record, cross, ... from numpy's)
                self.reasons.append(f"imports every name of {node.module}")
            if node.level or _import_of(node.module, alias) not in self.imports:
                self._importing("." * node.level + (node.module or ""))
                self._binding(alias.asname or alias.name)

    def visit_ClassDef(self, node):
        self._binding(node.name)
        self.generic_visit(node)

    def _binding(self, name: str):
        if self.local is None and name in self.protected:
            self.reasons.append(f"rebinds {name}, which the lab's own cells bind")

    def _importing(self, module: str):
        if module.split(".")[0] not in IMPORTABLE:
            self.reasons.append(f"imports {module}")

    def visit_Constant(self, node):
        if isinstance(node.value, str) and _names_a_special(node.value):
            self.reasons.append("names a special attribute in a string")

    def _binding_by_text(self, node):  # (``case x``, ``case {**x}``, ``except E as x``)
        for name in _text_names(node):
            self._binding(name)
        self.generic_visit(node)

    visit_MatchAs = visit_MatchStar = visit_MatchMapping = _binding_by_text
    visit_ExceptHandler = _binding_by_text

    def visit_Call(self, node):
        """A changing method called on what the lab's cells bind: ``cross.batches.clear()``."""
        method = node.func
        root = self._changing_method_of(method)
        if root is not None:
            self.reasons.append(f"calls {method.attr}() on {root}, which the lab's cells bind")
            self.called.add(id(method))
        if isinstance(method, ast.Name) and method.id == "type" and len(node.args) == 3:
            self.reasons.append("makes a class with type(), whose special methods it cannot read")
        self.generic_visit(node)

    def _changing_method_of(self, method) -> str | None:
        """The lab-bound name whose list, dict or set ``method`` would change, if it does."""
        if not (isinstance(method, ast.Attribute) and method.attr in CHANGING_METHODS):
            return None
        root = method.value
        while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
            root = root.func if isinstance(root, ast.Call) else root.value
        own = (self.local or set()) | self.comprehended  # (a local of the same name)
        if isinstance(root, ast.Name) and root.id in self.protected - own:
            return root.id
        return None

    def visit_Global(self, node):
        self.reasons.append(f"declares {', '.join(node.names)} global")

    def visit_Name(self, node):
        if node.id in REFUSED_NAMES:
            self.reasons.append(f"uses {node.id}")
        elif node.id.startswith("__") and isinstance(node.ctx, ast.Store):  # (in a class body)
            if node.id not in ALLOWED_SPECIAL_METHODS:
                self.reasons.append(f"defines the special method {node.id}")
        elif isinstance(node.ctx, (ast.Store, ast.Del)) and node.id not in self.comprehended:
            self._binding(node.id)

    def visit_ListComp(self, node):
        """A comprehension's loop names are its own (a walrus inside it is not)."""
        names = {
            n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)
        }
        outer, self.comprehended = self.comprehended, self.comprehended | names
        self.generic_visit(node)
        self.comprehended = outer

    visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_ListComp

    def visit_NamedExpr(self, node):
        outer, self.comprehended = self.comprehended, set()
        self.generic_visit(node)
        self.comprehended = outer

    def visit_Attribute(self, node):
        root = self._changing_method_of(node)
        if root is not None and id(node) not in self.called:  # (a decorator, kept for later)
            self.reasons.append(f"takes {node.attr}() of {root}, which the lab's cells bind")
        if node.attr.startswith("_"):
            self.reasons.append(f"reaches the attribute {node.attr}")
        elif node.attr in REFUSED_NAMES:
            self.reasons.append(f"uses {node.attr}")
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self._changing(node, f"changes the attribute {node.attr}")
        self.generic_visit(node)

    def visit_Subscript(self, node):
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self._changing(node, "changes an item")
        self.generic_visit(node)

    def _changing(self, target, what: str):
        """An attribute or item set or deleted: only on what the function owns."""
        root = target
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        own = self.top if self.local is None else self.local
        if not (isinstance(root, ast.Name) and root.id in own):
            self.reasons.append(f"{what} of something it did not make")

    def visit_FunctionDef(self, node):
        self._binding(node.name)
        if node.name.startswith("__") and node.name not in ALLOWED_SPECIAL_METHODS:
            # an operator or a conversion of its own: ``0 + x`` or ``float(x)`` may return anything
            self.reasons.append(f"defines the special method {node.name}")
        for decorator in node.decorator_list:
            self.visit(decorator)
        self._function(node, node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        self._function(node, [node.body])

    def _function(self, node, body):
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        outer, self.local = self.local, (self.local or set()) | _owned(node.args, body)
        for statement in body:
            self.visit(statement)
        self.local = outer


def _owned(arguments, body) -> set[str]:
    """The names a function owns: its parameters (but one whose default is another name's value)
    and names it binds to values it builds (a literal, a comprehension), unless it also binds
    them to anything else (a name, an attribute, an item, a call's result, a loop's item): any
    of those may be what already exists under another name."""
    positional = [*arguments.posonlyargs, *arguments.args]
    defaults = [None] * (len(positional) - len(arguments.defaults)) + arguments.defaults
    given = [*zip(positional, defaults), *zip(arguments.kwonlyargs, arguments.kw_defaults)]
    owned = {a.arg for a, default in given if default is None or _built(default)}
    owned |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
    built, bound = set(), []  # the Name nodes bound to a built value; every name bound
    for statement in body:
        for node in ast.walk(statement):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value:
                for target in getattr(node, "targets", None) or [node.target]:
                    built |= {id(name) for name, value in _pairs(target, node.value)
                              if _built(value)}  # fmt: skip
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                bound.append(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                owned.discard(node.name)
    owned |= {name.id for name in bound if id(name) in built}
    unbuilt = {name.id for name in bound if id(name) not in built}
    return owned - unbuilt - {n for s in body for n in _named_by_text(s)}


def _named_by_text(tree) -> set[str]:
    """The names the match patterns and except clauses in ``tree`` bind."""
    return {name for node in ast.walk(tree) for name in _text_names(node)}


def _text_names(node) -> list[str]:
    """The names one match pattern or except clause binds (held as text, not as Name nodes)."""
    if not isinstance(node, (ast.MatchAs, ast.MatchStar, ast.MatchMapping, ast.ExceptHandler)):
        return []
    return [n for n in (getattr(node, "name", None), getattr(node, "rest", None)) if n]


def _names_a_special(text: str) -> bool:
    """Whether ``text`` holds a double underscore that could spell a special name: one against a
    letter, digit or underscore, or standing alone ('__class__', '_' '_class__', '__'); prose
    with a blank beside it ('grads __') does not."""
    for run in re.finditer(r"__+", text):
        before = text[run.start() - 1] if run.start() else ""
        after = text[run.end()] if run.end() < len(text) else ""
        if not (before.isspace() or after.isspace()) or (before + after).replace(" ", "").isalnum():
            return True
    return False


_NO_ARGUMENTS = ast.arguments(
    posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]
)


def _pairs(target, value):
    """(Name node, the value it is bound to) for an assignment: ``a, b = 1, []`` pairs each name
    with its own element; a name unpacked from anything else is paired with None."""
    if isinstance(target, ast.Name):
        yield target, value
    elif isinstance(target, (ast.Tuple, ast.List)):
        elements = value.elts if isinstance(value, (ast.Tuple, ast.List)) else ()
        if len(elements) != len(target.elts) or any(
            isinstance(e, ast.Starred) for e in [*elements, *target.elts]
        ):
            elements = [None] * len(target.elts)
        for inner, element in zip(target.elts, elements):
            yield from _pairs(inner, element)


# Values a function builds itself: nothing that exists already can be one.
BUILT = (
    ast.Constant, ast.Dict, ast.DictComp, ast.GeneratorExp, ast.JoinedStr, ast.Lambda, ast.List,
    ast.ListComp, ast.Set, ast.SetComp, ast.Tuple,
)  # fmt: skip


def _built(value) -> bool:
    """Whether ``value`` is one a function builds and nothing else holds: a literal or a
    comprehension of such values or of calls' results (``[[], f(x)]``, not ``[cross]``), or one
    repeated or joined (``[None] * count``; the screen refuses an answer's own special
    methods)."""
    if isinstance(value, ast.BinOp):
        sides = (value.left, value.right)
        if any(isinstance(s, CONTAINERS) and not _built(s) for s in sides):
            return False
        return any(isinstance(s, CONTAINERS) for s in sides) or all(map(_built, sides))
    if isinstance(value, (ast.List, ast.Tuple, ast.Set)):
        return all(map(_held_built, value.elts))
    if isinstance(value, ast.Dict):
        return all(map(_held_built, value.values))
    if isinstance(value, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
        return _held_built(value.elt)
    if isinstance(value, ast.DictComp):
        return _held_built(value.value)
    return isinstance(value, BUILT)


def _held_built(element) -> bool:
    """An element of a container a function builds: built itself, or what a call returns."""
    return isinstance(element, ast.Call) or _built(element)


CONTAINERS = (ast.Dict, ast.DictComp, ast.List, ast.ListComp, ast.Set, ast.SetComp, ast.Tuple)


class ScreenAnswers(Preprocessor):
    """nbgrader's autograde, before the notebook runs: every code cell but the lab's own (answer
    cells, and any a student added) that :func:`screen` finds reasons in is replaced by one that
    raises them."""

    enabled = Bool(True)  # nbconvert's preprocessors are off unless told otherwise

    def preprocess(self, nb, resources):
        protected, imports = set(), set()
        for cell in nb.cells:
            if cell.cell_type == "code" and _is_the_labs(cell):
                protected |= _bound(cell.source)
                imports |= _imports(cell.source)
        for cell in nb.cells:
            if cell.cell_type == "code" and not _is_the_labs(cell):
                reasons = screen(cell.source, protected, imports)
                if reasons:
                    grade_id = cell.metadata.get("nbgrader", {}).get("grade_id", "an added cell")
                    self.log.warning("%s: screened out: %s", grade_id, "; ".join(reasons))
                    message = f"this answer cell was not run: it {'; it '.join(reasons)}"
                    cell.source = f"raise RuntimeError({message!r})"
        return nb, resources


def _is_the_labs(cell) -> bool:
    """A cell the release marked as the lab's own, locked or graded (nbgrader's autograde has put
    it back as the release wrote it); an answer cell, or one a student added, is not."""
    marks = cell.metadata.get("nbgrader", {})
    return not marks.get("solution") and bool(marks.get("locked") or marks.get("grade"))


def _bound(source: str) -> set[str]:
    """The names a lab cell binds in the notebook's namespace: at its top level (assignments,
    imports, definitions, loops, match and except names, in blocks too) and by a function's
    ``global``; not a function's, a class body's or a comprehension's own, nor ``_``. A hidden
    test's names are not the lab's: it binds them before it reads them."""
    tree = _parsed(source)
    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        names |= set(_text_names(node))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            names |= {n for g in ast.walk(node) if isinstance(g, ast.Global) for n in g.names}
        elif isinstance(
            node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
        ):
            names |= {n.target.id for n in ast.walk(node) if isinstance(n, ast.NamedExpr)}
        else:
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
            todo += ast.iter_child_nodes(node)
    return names - {"*", "_"}


def _imports(source: str) -> set[tuple]:
    """What a lab cell's imports bind, as (module, name, bound as): an answer may repeat them."""
    return {
        _import_of(getattr(node, "module", None), alias)
        for node in ast.walk(_parsed(source))
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
        for alias in node.names
    }


def _import_of(module: str | None, alias) -> tuple:
    """(module, name, bound as) of one imported name, written one way for both forms:
    ``import a.b as c`` and ``from a import b as c`` bind the same object."""
    if module is None and alias.asname and "." in alias.name:
        module, _, name = alias.name.rpartition(".")
        return module, name, alias.asname
    return module, alias.name, alias.asname or alias.name


def _parsed(source: str) -> ast.Module:
    """A lab cell without its hidden tests, parsed (empty if it does not parse)."""
    source = re.sub(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS", "", source, flags=re.S)
    try:
        return ast.parse(_python(source))
    except SyntaxError:
        return ast.Module([], [])


@sealed  # its class too: every sealed module shares it, so a property set there answers for all
class _Sealed(types.ModuleType, metaclass=ReadOnlyClass):
    """A module whose attributes a notebook cannot set or delete."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}":
            return super().__setattr__(name, value)  # the import system binding a submodule
        raise AttributeError(f"{self.__name__}.{name}: the course's modules are read-only here")

    def __delattr__(self, name):
        raise AttributeError(f"{self.__name__}.{name}: the course's modules are read-only here")


def seal_course_modules(*_) -> None:
    """Make every loaded module of the library and the course read-only to attribute writes
    (an IPython ``pre_run_cell`` callback: modules a cell imports are sealed before the next)."""
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in SEALED_PACKAGES and type(module) is types.ModuleType:
            module.__class__ = _Sealed


class ClearTracebacks(Preprocessor):
    """Feedback: each error output keeps its type and message, not the lines of its cell."""

    enabled = Bool(True)

    def preprocess_cell(self, cell, resources, index):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                output["traceback"] = [f"{output.get('ename', '')}: {output.get('evalue', '')}"]
        return cell, resources
