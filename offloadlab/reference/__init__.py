"""Reference measurements: JSON files with provenance, shown beside the reader's own numbers.

References live in two places, told apart by :func:`origin`:

- **packaged** — read-only data shipped inside the package (this folder, :data:`FOLDER`):
  ``nominal-ladder.json`` (datasheet-level figures from the book's references, marked nominal)
  and the measurements a maintainer committed from ``make gpu-check``;
- **user** — what ``offloadlab probe --reference NAME`` writes on the reader's machine, in
  :func:`user_folder` (``$OFFLOADLAB_REFERENCE_DIR``, else ``$XDG_DATA_HOME/offloadlab/reference``,
  else ``~/.local/share/offloadlab/reference``).

:func:`available` and :func:`load` see both; a name belongs to one place only, because
:func:`save` refuses in the user folder a name that a packaged reference has. Nothing replaces a
nominal reference, and :func:`save` writes into the package only when that folder is named
explicitly (``make gpu-check``, ``offloadlab probe --reference-dir``). Files are written whole
(a temporary file renamed into place) and never edited by hand.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..files import check_target, write_atomically

FOLDER = Path(__file__).resolve().parent
FORMAT = "offloadlab-reference/1"
USER_FOLDER_VARIABLE = "OFFLOADLAB_REFERENCE_DIR"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

__all__ = [
    "FOLDER",
    "FORMAT",
    "user_folder",
    "available",
    "origin",
    "load",
    "target",
    "save",
    "write",
]


def user_folder() -> Path:
    """Where this user's references go (the folder need not exist yet)."""
    if os.environ.get(USER_FOLDER_VARIABLE):
        return Path(os.environ[USER_FOLDER_VARIABLE]).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data_home) / "offloadlab" / "reference"


def _names(folder: Path) -> set[str]:
    return (
        {p.stem for p in folder.glob("*.json") if _NAME.fullmatch(p.stem)}
        if folder.is_dir()
        else set()
    )


def available(folder: Path | None = None) -> list[str]:
    """Names (without .json) of the packaged and the user's references, or of those in
    ``folder``."""
    if folder is not None:
        return sorted(_names(Path(folder)))
    return sorted(_names(FOLDER) | _names(user_folder()))


def origin(name: str) -> str:
    """'packaged' for a reference shipped with offloadlab, 'user' for one written on this
    machine."""
    return "packaged" if _path(name, None).parent == FOLDER else "user"


def _path(name: str, folder: Path | None) -> Path:
    """The file of an existing reference; ValueError listing what exists otherwise."""
    places = [Path(folder)] if folder is not None else [FOLDER, user_folder()]  # packaged names win
    if isinstance(name, str) and _NAME.fullmatch(name):
        for place in places:
            if (place / f"{name}.json").is_file():
                return place / f"{name}.json"
    raise ValueError(
        f"name: expected one of {', '.join(available(folder)) or 'no references'}; got {name!r}"
    )


def load(name: str, folder: Path | None = None) -> dict:
    """The reference called ``name`` (from ``folder``, or the packaged ones, then the user's)."""
    path = _path(name, folder)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # not JSON, or not UTF-8
        raise ValueError(f"{path}: not an {FORMAT} file ({error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not an {FORMAT} file")
    return data


def target(
    name: str,
    folder: Path | None = None,
    overwrite: bool = False,
    how_to_replace: str = "overwrite=True",
) -> Path:
    """The file :func:`save` would write for ``name``, checked now so a long measurement can be
    refused before it starts. ValueError for a bad or taken name, OSError for a folder that
    refuses files."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"name: expected letters, digits, '.', '_' or '-', starting with a letter or digit; "
            f"got {name!r}"
        )
    made_here = folder is None
    folder = user_folder() if made_here else Path(folder)
    if folder.resolve() != FOLDER and name in _names(FOLDER):
        raise ValueError(
            f"name: {name!r} is a reference shipped with offloadlab; choose another name"
        )
    path = folder / f"{name}.json"
    if path.is_file() and _kind(path) == "nominal":
        raise ValueError(
            f"name: {name!r} is nominal reference data, which is never replaced; choose another "
            "name"
        )
    if made_here:  # only once the name is accepted
        if folder.is_symlink() and not folder.exists():
            raise ValueError(
                f"name: the reference folder {str(folder)!r} is a symbolic link to a missing "
                f"folder ({os.readlink(folder)!r}); create that folder or remove the link"
            )
        if folder.exists() and not folder.is_dir():
            origin = (
                f" (from ${USER_FOLDER_VARIABLE})" if os.environ.get(USER_FOLDER_VARIABLE) else ""
            )
            raise ValueError(f"name: the reference folder {str(folder)!r}{origin} is not a folder")
        folder.mkdir(parents=True, exist_ok=True)
    return check_target(path, replace=overwrite, name="name", how_to_replace=how_to_replace)


def _kind(path: Path) -> str | None:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def save(
    name: str,
    kind: str,
    label: str,
    provenance: dict,
    records: list[dict],
    folder: Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a reference file from measured ``records`` into ``folder`` (default:
    :func:`user_folder`).

    Refuses to replace an existing file unless ``overwrite``; never replaces nominal data, and
    never takes a packaged reference's name outside the package. Returns the path written.
    """
    if kind not in ("measured", "emulated"):
        raise ValueError(f"kind: expected 'measured' or 'emulated'; got {kind!r}")
    return write(target(name, folder, overwrite), kind, label, provenance, records, overwrite)


def write(
    path: Path,
    kind: str,
    label: str,
    provenance: dict,
    records: list[dict],
    overwrite: bool = False,
) -> Path:
    """Write a reference to ``path``, which :func:`target` returned (before a long measurement).

    Only OSError can happen here: FileExistsError if, without ``overwrite``, a file appeared at
    ``path`` meanwhile (it is left as it is), or what the disk says.
    """
    payload = {
        "format": FORMAT,
        "kind": kind,
        "label": label,
        "provenance": provenance,
        "records": records,
    }
    return write_atomically(
        path, json.dumps(payload, indent=1, allow_nan=False) + "\n", replace=overwrite
    )
