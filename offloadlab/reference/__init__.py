"""Reference measurements: JSON files with provenance, shown beside the reader's own numbers.

``nominal-ladder.json`` holds the material's datasheet-level ladder and is marked nominal.
Every other file is written by :func:`save` from a real run (``offloadlab probe --reference``
or ``make gpu-check``) and is never edited by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
FORMAT = "offloadlab-reference/1"

__all__ = ["FOLDER", "FORMAT", "available", "load", "save"]


def available(folder: Path | None = None) -> list[str]:
    """Names of the reference files shipped with the package (without .json)."""
    return sorted(p.stem for p in (folder or FOLDER).glob("*.json"))


def load(name: str, folder: Path | None = None) -> dict:
    """The reference called ``name``; ValueError listing what exists otherwise."""
    path = (folder or FOLDER) / f"{name}.json"
    if not re.fullmatch(r"[A-Za-z0-9._-]+", str(name)) or not path.exists():
        raise ValueError(f"name: expected one of {', '.join(available(folder))}; got {name!r}")
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("format") != FORMAT:
        raise ValueError(f"{path.name}: not an {FORMAT} file")
    return data


def save(name: str, kind: str, label: str, provenance: dict, records: list[dict],
         folder: Path | None = None, overwrite: bool = False) -> Path:
    """Write a reference file from measured ``records``; refuses to replace one unless ``overwrite``."""
    if kind not in ("measured", "emulated"):
        raise ValueError(f"kind: expected 'measured' or 'emulated'; got {kind!r}")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ValueError(f"name: expected letters, digits, '.', '_' or '-'; got {name!r}")
    path = (folder or FOLDER) / f"{name}.json"
    if path.exists() and not overwrite:
        raise ValueError(f"name: {path} exists; choose another name or pass overwrite=True")
    payload = {"format": FORMAT, "kind": kind, "label": label, "provenance": provenance, "records": records}
    path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    return path
