"""The course page's snippets are valid as written (the page itself runs under nbval)."""

import ast
import re

from tests.conftest import ROOT

PAGE = (ROOT / "book" / "course.md").read_text(encoding="utf-8")


def test_the_hub_configuration_is_python_that_sets_a_gpu_and_the_memlock_limit():
    blocks = re.findall(r"```python\n(.*?)```", PAGE, re.DOTALL)
    assert blocks, "the course page lost its JupyterHub snippet"
    for block in blocks:
        tree = ast.parse(block)
        assert tree.body
    hub = blocks[0]
    assert '"memlock"' in hub and "device_requests" in hub and "pre_spawn_hook" in hub
    assert "OFFLOADLAB_STUDENT" in hub


def test_the_nbgrader_commands_name_assignments_that_make_student_writes():
    from offloadlab.student import assignment_name, find_labs

    assignments = {assignment_name(p) for p in find_labs(ROOT / "labs")}
    named = set(re.findall(r"nbgrader (?:generate_assignment|autograde) (\w+)", PAGE))
    assert named and named <= assignments
