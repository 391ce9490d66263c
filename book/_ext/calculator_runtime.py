"""The calculators' side of the page, inside Pyodide: run ``offloadlab <command>`` as the shell would.

The site's script hands over the form's fields; this builds the command line from them, runs the
package's own ``cli.main`` on it twice (as typed, then with ``--json``), and hands back what a
terminal would show: the exit status, the text, the JSON, and for a usage error (exit 2) its one
line and the field it names. Shipped in the calculators' archive beside the estimates layer.
"""

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

from offloadlab import cli

# A pasted config.json is written here (Pyodide's in-memory file system) and passed by this name,
# so that a message about it reads as `offloadlab plan --model-config config.json` would print it.
CONFIG = Path("config.json")


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    return status, out.getvalue(), err.getvalue()


def calculate(command: str, fields_json: str) -> str:
    """``fields_json``: [[flag, value, required], …] in the form's order. A field left empty is
    left out, unless the command requires it (then the CLI says what it expects). Returns JSON:
    {command, status, text, json, error, field}."""
    argv, flags = [command], []
    for flag, value, required in json.loads(fields_json):
        if not value.strip() and not required:
            continue
        if flag == "--model-config":
            CONFIG.write_text(value, encoding="utf-8")
            value = str(CONFIG)
        # a value starting with '-' (a negative count) would read as an option: joined to its flag
        argv += [f"{flag}={value}"] if value.startswith("-") else [flag, value]
        flags.append(flag)
    status, text, error = _run(argv)
    answer = {"command": shlex.join(["offloadlab", *argv]), "status": status, "text": text, "json": None,
              "error": error.strip(), "field": None}
    if status == 0:
        json_status, answer["json"], json_error = _run(argv + ["--json"])
        if json_status != 0:  # the same arguments cannot fail with --json: a bug, shown as one
            answer.update(status=json_status, error=json_error.strip())
    elif status == cli.USAGE_ERROR:
        answer["field"] = field_named(answer["error"], flags)
    return json.dumps(answer)


def field_named(message: str, flags: list[str]) -> str | None:
    """The flag, of those given, that a usage error is about: the first one it names
    ("… --link: expected …"), else the argument it starts with ("model: expected …")."""
    named = [flag for flag in re.findall(r"--[a-z][a-z-]*", message) if flag in flags]
    if named:
        return named[0]
    start = re.match(r"offloadlab: error: (?:offloadlab [a-z]+: )?([a-z_]+): ", message)
    flag = start and "--" + start.group(1).replace("_", "-")
    return flag if flag in flags else None
