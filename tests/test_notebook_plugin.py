"""The text-notebook plugin: collects Jupytext .md only, runs them with nbval, reports failures."""

import socket
import textwrap

import pytest

from tests.nbval_markdown import is_text_notebook


HEADER = textwrap.dedent("""\
    ---
    jupytext:
      text_representation:
        extension: .md
        format_name: myst
    kernelspec:
      display_name: Python 3
      language: python
      name: python3
    ---
    """)


def notebook(*cells: str) -> str:
    return (
        HEADER
        + "\n# A notebook\n\n"
        + "\n".join(f"```{{code-cell}} ipython3\n{c}\n```\n" for c in cells)
    )


def test_only_files_with_a_jupytext_header_are_notebooks(tmp_path):
    (tmp_path / "nb.md").write_text(notebook("x = 1"))
    (tmp_path / "plain.md").write_text("# Just prose\n\n```python\nx = 1\n```\n")
    (tmp_path / "other.md").write_text("---\ntitle: front matter but no jupytext\n---\n# Hi\n")
    assert is_text_notebook(tmp_path / "nb.md")
    assert not is_text_notebook(tmp_path / "plain.md")
    assert not is_text_notebook(tmp_path / "other.md")


@pytest.fixture
def project(pytester):
    pytester.makeconftest('pytest_plugins = ["tests.nbval_markdown"]')
    pytester.mkdir("book")
    pytester.mkdir("labs")
    return pytester


def test_passing_and_failing_notebooks(project):
    (project.path / "book" / "good.md").write_text(notebook("x = 6 * 7", "assert x == 42"))
    (project.path / "labs" / "bad.md").write_text(
        notebook("y = 1", "assert y == 2, 'y is not two'")
    )
    (project.path / "book" / "notes.md").write_text("# Plain notes, not collected\n")
    result = project.runpytest("--nbval-current-env", "-p", "no:cacheprovider", "book", "labs")
    result.assert_outcomes(passed=3, failed=1)
    output = result.stdout.str()
    assert "bad.md::Cell 1" in output and "y is not two" in output
    assert not list(project.path.rglob("*.ipynb")), "the plugin must not leave .ipynb files behind"


def test_a_port_taken_before_the_kernel_binds_it_does_not_kill_the_notebook(project, monkeypatch):
    """jupyter_client picks free ports and closes them; until the kernel binds them (seconds on a
    loaded machine) another process can take one. Here every port it picks is already taken: over
    TCP the kernel died at start-up and every cell of the notebook errored."""
    from jupyter_client.provisioning.local_provisioner import LocalPortCache

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    monkeypatch.setattr(
        LocalPortCache, "find_available_port", lambda self, ip: taken.getsockname()[1]
    )
    (project.path / "labs" / "lab.md").write_text(notebook("x = 6 * 7", "assert x == 42"))
    try:
        result = project.runpytest_inprocess(
            "--nbval-current-env", "-p", "no:cacheprovider", "labs"
        )
    finally:
        taken.close()
    result.assert_outcomes(passed=2)
