"""The student release: solutions replaced by stubs, answer checks kept, stops at the first exercise."""

import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from offloadlab.student import BEGIN, END, strip_solutions
from tests.conftest import ROOT


def test_strip_solutions_numbers_and_indents():
    source = f"x = 1\n{BEGIN}\nanswer = 42\n{END}\ndef f():\n    {BEGIN}\n    return 1\n    {END}\n"
    stripped, following = strip_solutions(source, first_exercise=3)
    assert 'raise NotImplementedError("exercise 3")' in stripped
    assert '    raise NotImplementedError("exercise 4")' in stripped
    assert "answer = 42" not in stripped and "return 1" not in stripped and following == 5
    with pytest.raises(ValueError, match="without"):
        strip_solutions(f"{BEGIN}\nx = 1\n")
    with pytest.raises(ValueError, match="without"):
        strip_solutions(f"x = 1\n{END}\n")


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    target = tmp_path_factory.mktemp("student")
    result = subprocess.run([sys.executable, "-m", "offloadlab.student", "labs", str(target)], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return target


def test_every_lab_is_released_without_solutions(release):
    labs = sorted(p.stem for p in (ROOT / "labs").glob("lab*.md"))
    assert sorted(p.stem for p in release.glob("*.ipynb")) == labs
    for path in release.glob("*.ipynb"):
        sources = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
        assert BEGIN not in sources and END not in sources, path.name
        assert 'raise NotImplementedError("exercise 1")' in sources, path.name
        assert "assert" in sources, path.name  # the answer checks stay
        for cell in nbformat.read(path, as_version=4).cells:  # the stubs are not folded as the answers are
            assert not cell.metadata.get("jupyter", {}).get("source_hidden"), path.name
            assert "hide-input" not in cell.metadata.get("tags", []), path.name


@pytest.mark.parametrize("lab", ["lab01_account_for_every_byte", "lab03_hide_a_transfer"])
def test_student_notebook_runs_up_to_its_first_exercise(release, lab):
    notebook = nbformat.read(release / f"{lab}.ipynb", as_version=4)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(release)}})
    with pytest.raises(CellExecutionError) as info:
        client.execute()
    assert "NotImplementedError" in str(info.value) and "exercise 1" in str(info.value)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    failed = next(i for i, c in enumerate(code) if any(o.get("ename") == "NotImplementedError" for o in c.get("outputs", [])))
    assert 'NotImplementedError("exercise 1")' in code[failed].source
    assert all(c.get("execution_count") for c in code[:failed])  # everything before it ran


def test_bad_arguments():
    result = subprocess.run([sys.executable, "-m", "offloadlab.student", "no-such-folder", "out"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 2 and "source_dir" in result.stderr and "Traceback" not in result.stderr
