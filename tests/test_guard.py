"""What keeps a lab's grade out of its answer cells' reach (offloadlab_course/guard.py).

Each way a dishonest student tried, or could try, to change the checks from an answer cell is
screened out before autograding runs it; every lab's worked answers pass the screen untouched;
an alias the screen cannot follow fails in the kernel, where the course's modules are sealed;
and feedback keeps an error's message, never the lines of its cell.
"""

import nbformat
import pytest

from offloadlab_course.guard import ClearTracebacks, ScreenAnswers, screen
from offloadlab_course.student import find_labs, source_notebook
from tests.conftest import ROOT

LABS = find_labs(ROOT / "labs")
# names a lab's own cells bind, as in lab 3
PROTECTED = {"check", "grading", "link", "torch", "overlap", "nbytes", "bandwidth"}

ATTACKS = {
    "rebind a check": ("check.answer = lambda *a, **k: True", "changes the attribute answer"),
    "rebind a challenge": (
        "grading.lab03_challenge = lambda *a, **k: True",
        "changes the attribute lab03_challenge",
    ),
    "replace the module": ("class check:\n    answer = print", "rebinds check"),
    "replace a measurement": ("bandwidth = 1e12\nmy_x = 1", "rebinds bandwidth"),
    "through an alias": ("c = check\nc.answer = print", "changes the attribute answer"),
    "setattr": ("setattr(check, 'answer', print)", "uses setattr"),
    "the module's dict": ("check.__dict__['answer'] = print", "reaches the attribute __dict__"),
    "vars": ("vars(check)['answer'] = print", "uses vars"),
    "sys.modules": ("import sys\nsys.modules['offloadlab_course.check'] = 0", "imports sys"),
    "the course package": ("from offloadlab_course import check as c", "imports offloadlab_course"),
    "exec": ("exec('check.answer = print')", "uses exec"),
    "global": ("def my_f():\n    global check\n    check = 0", "declares check global"),
    "a loop target": ("for check.answer in [print]:\n    pass", "changes the attribute answer"),
    "a walrus": ("my_x = [(check := 0) for _ in [1]]", "rebinds check"),
    "a patched class": (
        "def my_f(model):\n    torch.Tensor.element_size = lambda self: 0",
        "changes the attribute element_size",
    ),
    "an alias inside a function": (
        "def my_f():\n    T = torch.Tensor\n    T.element_size = lambda self: 0",
        "changes the attribute element_size",
    ),
    "a parameter's default": (
        "def my_f(t=torch.Tensor):\n    t.element_size = len",
        "changes the attribute element_size",
    ),
    # found by a reviewer playing a dishonest student, each screened clean before
    "a module's dict through attrgetter": (
        'import operator\noperator.attrgetter("__dict__")(check).update(answer=print)',
        "uses attrgetter",
    ),
    "builtins through another module": (
        "import dataclasses\ndef my_f(b):\n    b.abs = len\nmy_f(dataclasses.builtins)",
        "uses builtins",
    ),
    "exec as an attribute": ("import dataclasses\ndataclasses.builtins.exec('1')", "uses exec"),
    "a magic": ("%env OFFLOADLAB_STUDENT=0", "uses get_ipython"),
    "a timed change": ("%time check.answer = print", "changes the attribute answer"),
    "a timed cell's change": ("%%time\ncheck.answer = print", "changes the attribute answer"),
    "an item of a measurement": ("link.rates['h2d'] = 1e15", "changes an item"),
    # found by the seventeenth probe pass, each screened clean before
    "a hidden rate through the base class's property": (
        "my_x = EmulatedLink.bandwidth.fget(link)",
        "uses fget",
    ),
    "a hidden rate through super": ("my_x = super(type(link), link).bandwidth", "uses super"),
    "the grader's locals through a generator's frame": (
        "def my_f(*a):\n    def peek():\n        yield me.gi_frame.f_back.f_locals['expected']\n"
        "    me = peek()\n    return next(me)",
        "uses gi_frame",
    ),
    # found by the eighteenth probe pass
    "inspect through another module": (
        "import dataclasses\nmy_x = dataclasses.inspect.getattr_static(link, 'x')",
        "uses inspect",
    ),
    "a file of the course": ("my_x = open('../source/lab02/lab02.ipynb').read()", "uses open"),
    "a pickle": ("import numpy\nmy_x = numpy.load('x.npy', allow_pickle=True)", "uses load"),
    "the sealed modules' class": (
        "def my_f():\n    t = type(check)\n    t.answer = property(lambda m: print)\nmy_f()",
        "changes the attribute answer",
    ),
    # a call may return what already exists: only a value the function builds is its own
    "an alias through a call": (
        "def my_f():\n    F = next(iter([check.Fraction]))\n    F.numerator = property(len)",
        "changes the attribute numerator",
    ),
    "an alias after a fresh value": (
        "def my_f():\n    t = 0\n    t = torch\n    t.equal = len",
        "changes the attribute equal",
    ),
    "an alias unpacked from a fresh list": (
        "def my_f():\n    t, = [torch]\n    t.equal = len",
        "changes the attribute equal",
    ),
    "an alias as a loop's name": (
        "def my_f():\n    for t in [torch]:\n        t.equal = len",
        "changes the attribute equal",
    ),
    "an operator of its own that returns an alias": (
        "class my_A:\n    def __radd__(self, other):\n        return torch\n"
        "def my_f():\n    t = 0 + my_A()\n    t.equal = len",
        "defines the special method __radd__",
    ),
    # found by the nineteenth probe pass, each screened clean before
    "a hidden rate through a format field": (
        "my_x = float('{0._bandwidth}'.format(link))",
        "uses format",
    ),
    "a format field through the Formatter": (
        "import string\nmy_x = string.Formatter().get_field('0._bandwidth', [link], {})",
        "imports string",
    ),
    "a module through torch's importlib": (
        "my_m = torch.importlib.import_module('string')",
        "uses importlib",
    ),
    "the release's switch": ("torch.os.environ.pop('OFFLOADLAB_STUDENT', None)", "uses environ"),
    "the lab's measurement cleared": ("overlap.clear()\nmy_x = None", "calls clear() on overlap"),
    "a special method in a class body": (
        "class my_N:\n    __float__ = lambda self: 1.0",
        "defines the special method __float__",
    ),
    "an alias through either side of an or": (
        "def my_f():\n    t = None or torch\n    t.equal = len",
        "changes the attribute equal",
    ),
    # the twentieth probe pass: a match pattern's and an except clause's names are strings
    "a match capture": ("match [my_C(), 1]:\n    case [check, _]:\n        pass", "rebinds check"),
    "a match star": ("match [1, 2]:\n    case [*overlap]:\n        pass", "rebinds overlap"),
    "a match mapping's rest": ("match {}:\n    case {**check}:\n        pass", "rebinds check"),
    "a match alias": ("match 1:\n    case 1 as check:\n        pass", "rebinds check"),
    "an except clause's name": (
        "try:\n    1 / 0\nexcept ZeroDivisionError as check:\n    pass",
        "rebinds check",
    ),
    "a name in a string": ("my_x = '__class__'", "names a special attribute in a string"),
    "a star import": ("from numpy import *", "imports every name of numpy"),
    "a changing method taken, not called": (
        "@overlap.append\ndef my_f():\n    pass",
        "takes append() of overlap, which the lab's cells bind",
    ),
    "a changing method kept for later": (
        "my_add = overlap.append\nmy_add(1)",
        "takes append() of overlap, which the lab's cells bind",
    ),
    "a lab object inside a literal the cell builds": (
        "my_l = [overlap]\nmy_l[0].window = 0",
        "changes the attribute window of something it did not make",
    ),
    "a lab object inside a literal a function builds": (
        "def my_f():\n    l = [overlap] * 1\n    l[0].window = 0",
        "changes the attribute window of something it did not make",
    ),
    "a pickled call": (
        'torch.serialization.pickle.loads(b"csys\\nsetprofile\\n(NtR.")',
        "uses pickle",
    ),
    "a thread left running": (
        "t = torch.utils.data.dataloader.threading.Thread(target=print)",
        "uses threading",
    ),
    "the release switch, in bytes": (
        "def f(e):\n    e[b'OFFLOADLAB_STUDENT'] = b'0'\nf(torch.serialization.os.environb)",
        "uses environb",
    ),
    "a file read as a tensor": (
        "t = torch.from_file('lab01.md', size=10, dtype=torch.uint8)",
        "uses from_file",
    ),
    "a file object": (
        "f = torch.serialization.io.FileIO('x', 'w')",
        "uses FileIO",
    ),
    "a thread pool": (
        "pool_ = probe.ThreadPoolExecutor(1)\nmy_x = pool_.submit(int).result()",
        "uses ThreadPoolExecutor",
    ),
    "a class whose special methods are built strings": (
        "K_ = type('K', (), {'_' + '_eq__': lambda s, o: True})",
        "makes a class with type()",
    ),
    "a dataclass from a namespace": (
        "K_ = dataclasses.make_dataclass('K', [], namespace={})",
        "uses make_dataclass",
    ),
    "a file read by a pattern": (
        "t = numpy.fromregex('lab01.md', '(.)', [('c', 'S1')])",
        "uses fromregex",
    ),
    "a process": ("torch.serialization.os.spawnlp(0, 'id', 'id')", "uses spawnlp"),
    "a lab object inside a comprehension": (
        "def my_f():\n    l = {k: overlap for k in 'ab'}\n    l['a'].window = 0",
        "changes the attribute window of something it did not make",
    ),
}


@pytest.mark.parametrize("attack", ATTACKS, ids=str)
def test_each_way_around_the_checks_is_screened_out(attack):
    source, reason = ATTACKS[attack]
    reasons = screen(source, PROTECTED)
    assert any(reason in r for r in reasons), reasons


@pytest.mark.parametrize(
    "source",
    [
        "my_x = 16 * P  # names of its own",
        "def my_f(p):\n    p.grad = None  # a parameter the function was given",
        "def my_f(model):\n    cache = {}\n    cache['a'] = model\n    return cache",
        "my_x = [link for link in range(3)]  # a comprehension's own name",
        "import math\nfrom offloadlab import overlap as o\nmy_x = math.ceil(2.5)",
        "def my_f(items, link):\n    nonlocal_free = link.mark()\n    return nonlocal_free",
        "%time my_x = 16 * P  # timed",
        "%%time\nmy_x = 16 * P",
        # the twentieth probe pass: a dict an answer builds and fills, underscores in prose
        "my_d = {'a': 1}\nmy_d['extra'] = 0\nmy_d.update(b=2)\nmy_x = sum(my_d.values())",
        "my_note = 'state: __ weights + grads __'\nmy_x = 16 * P",
        "match P:\n    case int(my_n):\n        my_x = 16 * my_n",
    ],
)
def test_plain_answers_pass_the_screen(source):
    assert screen(source, PROTECTED) == []


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_every_worked_answer_passes_the_screen_untouched(path):
    notebook = source_notebook(path)
    before = [c.source for c in notebook.cells]
    ScreenAnswers()(notebook, {})  # as nbgrader calls it
    assert [c.source for c in notebook.cells] == before


def test_a_screened_cell_raises_its_reasons_instead_of_running():
    notebook = nbformat.v4.new_notebook()
    setup = nbformat.v4.new_code_cell("from offloadlab_course import check")
    setup.metadata["nbgrader"] = {"locked": True, "grade_id": "lab-cell-1"}  # as released
    answer = nbformat.v4.new_code_cell("check.answer = print\nmy_x = 1")
    answer.metadata["nbgrader"] = {"solution": True, "grade_id": "answer-1"}
    # a cell the student added: no nbgrader marks, so not the lab's own (nineteenth pass, F14)
    added = nbformat.v4.new_code_cell("check.answer = print")
    notebook.cells = [setup, answer, added]
    ScreenAnswers()(notebook, {})  # as nbgrader calls it
    assert answer.source.startswith("raise RuntimeError(")
    assert "changes the attribute answer of something it did not make" in answer.source
    assert added.source.startswith("raise RuntimeError(") and "rebinds" not in added.source
    assert setup.source == "from offloadlab_course import check"


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_every_code_cell_of_a_release_is_the_labs_own_or_an_answer(path):
    """The release marks each of the lab's code cells locked, so the screen tells them from a
    cell a student adds, which it reads as it reads an answer."""
    for cell in source_notebook(path).cells:
        if cell.cell_type == "code":
            marks = cell.metadata["nbgrader"]
            assert marks["solution"] or marks["locked"], cell.source[:80]


def test_in_the_kernel_the_course_modules_refuse_what_an_alias_writes():
    """What the screen cannot follow (here, an alias made where the screen does not look)
    fails when it runs: the labs' checks seal the course's and the library's modules."""
    from tests.kernels import start_kernel

    manager, client = start_kernel()
    try:

        def run(code):
            reply = client.execute_interactive(code, timeout=120, output_hook=lambda m: None)
            return reply["content"]

        assert run("from offloadlab_course import check, grading")["status"] == "ok"
        written = run("c = [check][0]\nc.answer = print")
        assert written["status"] == "error" and "read-only" in written["evalue"], written
        assert run("from offloadlab import nvme")["status"] == "ok"  # a submodule still imports
        assert run("assert check.answer is not print")["status"] == "ok"
        # the class every sealed module shares: a property set there would answer for them all
        on_the_class = run("t = [type(check)][0]\nt.answer = property(lambda m: print)")
        assert on_the_class["status"] == "error" and "read-only" in on_the_class["evalue"]
        assert run("assert check.answer is not print")["status"] == "ok"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_in_the_kernel_a_check_fails_when_an_answer_changed_what_it_relies_on():
    """What neither the screen nor the seal stops (a class handed to a function as a parameter,
    outside the sealed modules) is found when a check would pass: it fails, naming the change."""
    from tests.kernels import start_kernel

    manager, client = start_kernel()
    try:

        def run(code):
            printed = []

            def keep(message):
                if message["msg_type"] == "stream":
                    printed.append(message["content"]["text"])

            reply = client.execute_interactive(code, timeout=120, output_hook=keep)
            return reply["content"]["status"], "".join(printed)

        assert run("from offloadlab_course import check, grading") == ("ok", "")
        # what torch changes itself as it runs is no answer's doing: the first optimizer of a
        # class wraps its step, dynamo wraps manual_seed, pickling caches a class's slot names
        honest = (
            "import pickle\nmy_opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])\n"
            "my_copy = pickle.loads(pickle.dumps(my_opt))\ntorch.compiler.disable(len)\n"
            "torch.manual_seed(0)"
        )
        assert run("import torch") == ("ok", "") and run(honest)[0] == "ok"
        assert run("assert check.answer('x', 1.0, 1.0)")[0] == "ok"
        # every difference zero: 5.0 would pass for 1.0
        patched = "def my_f(F):\n    F.numerator = property(lambda f: 0)\nmy_f(check.Fraction)"
        assert screen(patched, {"check"}) == []
        assert run(patched)[0] == "ok"
        status, printed = run("my_x = bool(check.answer('x', 5.0, 1.0))\nprint(my_x)")
        assert status == "ok", printed
        assert printed.endswith("False\n"), printed
        assert "changed fractions.Fraction.numerator" in printed, printed
        # a challenge's outcome the same way
        status, printed = run("print(bool(grading.Outcome(True, '✓ challenge: met')))")
        assert "✗ challenge: not checked" in printed and printed.endswith("False\n"), printed
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_feedback_keeps_an_errors_message_and_drops_its_lines():
    cell = nbformat.v4.new_code_cell("assert again == expected  # a hidden test")
    cell.outputs = [
        nbformat.v4.new_output(
            "error",
            ename="AssertionError",
            evalue="not computed from the transfer",
            traceback=["----> 3 assert again == expected  # a hidden test"],
        )
    ]
    notebook = nbformat.v4.new_notebook(cells=[cell])
    ClearTracebacks()(notebook, {})  # as nbgrader calls it
    assert cell.outputs[0].traceback == ["AssertionError: not computed from the transfer"]


def test_a_number_that_redefines_its_arithmetic_is_checked_as_the_number_it_holds(capsys):
    """A Fraction subclass whose difference from anything is 0 passed every check."""
    from fractions import Fraction

    from offloadlab_course import check

    class Anything(Fraction):
        def __eq__(self, other):
            return True

        def __sub__(self, other):
            return 0

        __hash__ = Fraction.__hash__

    assert not check.answer("bytes", Anything(1), 16 * 10**6, rel_tol=0.01)
    assert not check.exact("count", Anything(1), 7)
    assert check.answer("bytes", Fraction(16 * 10**6), 16 * 10**6, rel_tol=0.01)


LAB_CELL = """import numpy as np
import matplotlib.pyplot as plt
from offloadlab import memory
from offloadlab.memory import state_bytes
record = 1


def measure(rounds):
    steps = [p for p in range(rounds)]
    for r in steps:
        pass
    return steps


measured, _ = measure(3), None
### BEGIN HIDDEN TESTS
expected, more = 2, 3
### END HIDDEN TESTS
"""


@pytest.mark.parametrize(
    "answer, refused",
    [
        ("import numpy as np\nmy_x = np.ones(3).sum()", None),
        ("from offloadlab.memory import state_bytes\nmy_x = 1", None),
        ("import matplotlib.pyplot as plt\nimport offloadlab.memory as memory", None),
        ("import matplotlib as plt", "rebinds plt"),
        ("from offloadlab import probe as memory", "rebinds memory"),
        ("expected = 2 * 3\nmore = expected + 1", None),
        ("for r in range(3):\n    my_x = r\n_ = my_x\np, steps = 1, 2", None),
        ("import torch as np", "rebinds np"),
        ("from offloadlab.memory import get_recipe as state_bytes", "rebinds state_bytes"),
        ("record = 2", "rebinds record"),
        ("measured = 0", "rebinds measured"),
    ],
)
def test_at_autograde_only_the_names_the_lab_binds_for_its_checks_are_protected(answer, refused):
    """Twenty-second pass F9: every name bound anywhere in the lab's cells was protected, the
    hidden tests' own (``expected``), a function's locals (``p``, ``r``), ``_`` and the lab's
    imports repeated (``import numpy as np``) too, so these honest answers scored 0."""
    lab = nbformat.v4.new_code_cell(LAB_CELL)
    lab.metadata["nbgrader"] = {"locked": True, "grade_id": "lab-cell-1"}
    cell = nbformat.v4.new_code_cell(answer)
    cell.metadata["nbgrader"] = {"solution": True, "grade_id": "answer-1"}
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [lab, cell]
    ScreenAnswers()(notebook, {})
    if refused is None:
        assert cell.source == answer
    else:
        assert cell.source.startswith("raise RuntimeError(") and refused in cell.source
