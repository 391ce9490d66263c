"""The set-up files agree with each other: pyproject, environment.yml, the Makefile, the Lab
settings."""

import json
import re
import sys
import tomllib
from pathlib import Path

import yaml

from tests.conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENVIRONMENT = yaml.safe_load((ROOT / "environment.yml").read_text())
MAKEFILE = (ROOT / "Makefile").read_text()


# The extras every environment installs; `peers` (DeepSpeed, Accelerate, torchao) stays optional.
ENVIRONMENT_EXTRAS = {"lab", "book", "test"}


def extras_in(spec: str) -> set[str]:
    match = re.search(r"\.\[([a-z,_-]+)\]", spec)
    assert match, f"no extras in {spec!r}"
    return set(match.group(1).split(","))


def test_runtime_dependencies_declared():
    names = {re.split(r"[<>=!~ ]", d)[0] for d in PYPROJECT["project"]["dependencies"]}
    # (matplotlib is the course's: course/pyproject.toml)
    assert names == {"torch", "numpy", "psutil", "tqdm"}
    assert "torch>=2.4" in PYPROJECT["project"]["dependencies"]


def test_environment_yml_installs_the_project_with_every_extra():
    deps = ENVIRONMENT["dependencies"]
    assert "pip" in deps
    python = next(d for d in deps if isinstance(d, str) and d.startswith("python"))
    minimum = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, python.split("=")[-1].split("."))) >= tuple(map(int, minimum.split(".")))
    pip_lines = next(d["pip"] for d in deps if isinstance(d, dict))
    assert pip_lines[1:] == ["-e ./course"], (
        "environment.yml lists packages of its own: keep them in pyproject.toml (the course's in "
        "course/pyproject.toml)"
    )
    assert extras_in(pip_lines[0]) == ENVIRONMENT_EXTRAS
    assert ENVIRONMENT_EXTRAS <= set(PYPROJECT["project"]["optional-dependencies"])


def test_makefile_installs_the_same_extras_and_the_course():
    install = re.search(r'pip install --quiet -e "(\.\[[^\]]+\])" -e \./course\n', MAKEFILE)
    assert install, "the Makefile's env target does not install the project and the course"
    assert extras_in(install.group(1)) == ENVIRONMENT_EXTRAS


def test_lab_opens_markdown_as_notebooks_by_default():
    overrides = json.loads((ROOT / "etc" / "jupyterlab-overrides.json").read_text())
    viewers = overrides["@jupyterlab/docmanager-extension:plugin"]["defaultViewers"]
    assert viewers["markdown"] == viewers["myst"] == "Jupytext Notebook"
    in_environment = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    assert in_environment.exists(), (
        "run `make env`: the environment lacks the Lab settings override"
    )
    assert json.loads(in_environment.read_text()) == overrides


def test_the_makefile_documents_python_and_torch():
    header = MAKEFILE.split("\n\n", 1)[0]
    assert "PYTHON=" in header and "TORCH=" in header and "torch==2.13.0" in header


def test_make_student_and_lab_use_the_environment_as_it_is():
    """An instructor who cannot write to a shared environment can still release the labs."""
    import subprocess

    result = subprocess.run(
        ["make", "-n", "student", f"VENV={Path(sys.prefix)}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "offloadlab_course.student" in result.stdout, result.stderr
    assert "pip install" not in result.stdout and "venv" not in result.stdout.replace(
        str(Path(sys.prefix)), ""
    )


def test_make_course_refuses_what_the_students_could_not_read(tmp_path):
    import subprocess

    private = tmp_path / "private"
    (private / "checkout").mkdir(parents=True)
    private.chmod(0o700)
    result = subprocess.run(
        [sys.executable, str(ROOT / "course" / "check_shared.py"), str(private / "checkout")],
        capture_output=True,
        text=True,
    )
    assert (
        result.returncode == 2
        and "other users cannot read" in result.stderr
        and "Traceback" not in result.stderr
    )
    # the first folder in the way is named
    assert str(private) in result.stderr or "PYTHON" in result.stderr


def test_jupyterlab_myst_loads_in_the_jupyterlab_it_ships_with():
    """`jupyter labextension list` says whether each extension fits the installed JupyterLab."""
    import subprocess

    result = subprocess.run(
        [str(Path(sys.prefix) / "bin" / "jupyter"), "labextension", "list"],
        capture_output=True,
        text=True,
    )
    listing = result.stdout + result.stderr
    myst = next(line for line in listing.splitlines() if "jupyterlab-myst" in line)
    assert "OK" in myst and "not compatible" not in listing, listing
