"""The student release of the labs: solutions replaced by stubs, answer checks kept.

Lab solutions sit between nbgrader's ``### BEGIN SOLUTION`` and ``### END SOLUTION`` lines,
so an instructor can hand the sources to nbgrader directly. Without nbgrader,
``python -m offloadlab.student labs build/student`` (``make student``) writes each lab as a
notebook (``.ipynb``) whose solution code is replaced by
``raise NotImplementedError("exercise N")``, N counting the lab's exercises from 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["strip_solutions", "release"]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def strip_solutions(source: str, first_exercise: int = 1) -> tuple[str, int]:
    """``source`` with every solution block replaced by a stub; returns (text, next exercise number)."""
    lines, out, number, inside = source.splitlines(), [], first_exercise, False
    for lineno, line in enumerate(lines, 1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"source: line {lineno}: {BEGIN} inside another solution")
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f'{indent}raise NotImplementedError("exercise {number}")  # your answer here')
            number, inside = number + 1, True
        elif marker == END:
            if not inside:
                raise ValueError(f"source: line {lineno}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"source: {BEGIN} without {END}")
    return "\n".join(out), number


def unfold(cell) -> None:
    """Show a stub cell: the sources fold their worked answers (``make format``), a student's stub is not hidden."""
    cell.metadata.get("jupyter", {}).pop("source_hidden", None)
    if not cell.metadata.get("jupyter", True):
        del cell.metadata["jupyter"]
    tags = [t for t in cell.metadata.get("tags", []) if t != "hide-input"]
    if tags:
        cell.metadata["tags"] = tags
    else:
        cell.metadata.pop("tags", None)


def release(source_dir: Path, target_dir: Path) -> list[Path]:
    """Write the student notebook of every Jupytext lab in ``source_dir`` into ``target_dir``."""
    import jupytext

    source_dir, target_dir = Path(source_dir), Path(target_dir)
    if not source_dir.is_dir():
        raise ValueError(f"source_dir: expected a folder of labs; got {str(source_dir)!r}")
    target_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(source_dir.glob("*.md")):
        if "jupytext:" not in path.read_text(encoding="utf-8")[:2000]:
            continue
        notebook = jupytext.read(path)
        number = 1
        for cell in notebook.cells:
            if cell.cell_type == "code" and BEGIN in cell.source:
                cell.source, number = strip_solutions(cell.source, number)
                unfold(cell)
        out = target_dir / path.with_suffix(".ipynb").name
        jupytext.write(notebook, out)
        written.append(out)
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m offloadlab.student LABS_DIR TARGET_DIR", file=sys.stderr)
        return 2
    try:
        for path in release(Path(argv[0]), Path(argv[1])):
            print(f"wrote {path}")
    except ValueError as error:
        print(f"offloadlab.student: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
