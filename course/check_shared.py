"""Refuse to build a course environment that the students could not run (``make course``).

Run with the Python that is to make the environment, and the checkout's folder as argument. A
course's single-user servers run as each student, so the interpreter, its standard library and
the checkout (the environment imports offloadlab from it) must be readable by users other than
the one who builds it: a Python under a private home (``/root/.pyenv``) gives every student
``bad interpreter: Permission denied``. Exit status 2 and one line naming the first folder or
file in the way, and what to do.
"""

import os
import stat
import sys
import sysconfig
from pathlib import Path


def blocked(path: Path) -> Path | None:
    """The first folder on the way to ``path`` that others cannot enter, or ``path`` itself when
    others cannot read it; None when everything is open to them."""
    path = Path(os.path.realpath(path))
    for folder in reversed(path.parents):
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return folder
    mode = os.stat(path).st_mode
    needed = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) or os.access(path, os.X_OK) else 0)
    return None if mode & needed == needed else path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python course/check_shared.py CHECKOUT", file=sys.stderr)
        return 2
    checks = [
        ("PYTHON", Path(sys.executable)),
        ("PYTHON's standard library", Path(sysconfig.get_path("stdlib"))),
        ("the checkout", Path(argv[0])),
    ]
    for what, path in checks:
        if not path.exists():
            print(f"make course: {what}: {str(path)!r} does not exist", file=sys.stderr)
            return 2
        stop = blocked(path)
        if stop is not None:
            print(
                f"make course: {what}: other users cannot read {str(stop)!r} (on the way to "
                f"{str(path)!r}), so students could not run the environment; use a Python every "
                "user can run (PYTHON=/usr/bin/python3) and a checkout outside private homes "
                "(/opt/offloadlab)",
                file=sys.stderr,
            )
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
