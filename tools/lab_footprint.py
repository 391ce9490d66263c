"""Measure what each lab costs a hub: the peak memory and the CPU time of a kernel running it.

    python tools/lab_footprint.py [--threads N] [--labs lab01,lab03] [--out FILE] [--force]

Each lab runs with its worked answers, as the grader runs a solved submission, in a kernel of
its own started in labs/, with OMP_NUM_THREADS=N (the hub's OFFLOADLAB_THREADS) and student
mode on. A thread samples the resident memory of the kernel and its children every 50 ms; the
CPU time is the kernel's own (user + system) at the end. Labs run one after another, so the
figures are each lab's alone. The record (JSON, with the machine, torch and the date) is what
book/course.md's sizing table reads: course/lab-footprint.json unless --out says otherwise.
Exit status 2 and one line for a bad argument or an output that exists without --force.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "course" / "lab-footprint.json"


def peak_while(pid: int, stop: threading.Event, peak: list[int]) -> None:
    """Keep the largest resident set of ``pid`` and its children in ``peak[0]`` until ``stop``."""
    import psutil

    process = psutil.Process(pid)
    while not stop.is_set():
        try:
            tree = [process, *process.children(recursive=True)]
            peak[0] = max(peak[0], sum(p.memory_info().rss for p in tree))
        except psutil.NoSuchProcess:
            return
        stop.wait(0.05)


def measure(path: Path, threads: int) -> dict:
    """Run the lab at ``path`` with its worked answers; its peak memory (bytes), CPU and wall
    seconds."""
    import psutil
    from nbclient import NotebookClient

    from offloadlab_course.student import source_notebook

    notebook = source_notebook(path)
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "OFFLOADLAB_STUDENT": "1"}
    folder = {"metadata": {"path": str(path.parent)}}
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", resources=folder)
    peak, stop = [0], threading.Event()
    started = time.perf_counter()
    with client.setup_kernel(env=environment, cwd=str(path.parent)):
        pid = client.km.provisioner.process.pid
        watcher = threading.Thread(target=peak_while, args=(pid, stop, peak), daemon=True)
        watcher.start()
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
        times = psutil.Process(pid).cpu_times()
        stop.set()
        watcher.join()
    return {
        "peak_rss_bytes": peak[0],
        # the kernel's own, and its children's that have ended (lab 8's torchrun processes)
        "cpu_seconds": round(
            times.user + times.system + times.children_user + times.children_system, 1
        ),
        "wall_seconds": round(time.perf_counter() - started, 1),
    }


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lab_footprint", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per kernel")
    parser.add_argument("--labs", default="", help="comma-separated assignment names (default all)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    from offloadlab_course.student import assignment_name, find_labs

    arguments = parse(argv)
    labs = {assignment_name(p): p for p in find_labs(ROOT / "labs")}
    chosen = [name for name in arguments.labs.split(",") if name] or list(labs)
    unknown = [name for name in chosen if name not in labs]
    if unknown:
        print(
            f"lab_footprint: --labs: expected some of {', '.join(labs)}; got {unknown[0]!r}",
            file=sys.stderr,
        )
        return 2
    if arguments.threads < 1:
        print(
            f"lab_footprint: --threads: expected a whole number ≥ 1; got {arguments.threads}",
            file=sys.stderr,
        )
        return 2
    if arguments.out.exists() and not arguments.force:
        print(f"lab_footprint: --out: {arguments.out} exists; --force replaces it", file=sys.stderr)
        return 2
    import psutil
    import torch

    record = {
        "command": "python tools/lab_footprint.py " + " ".join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "threads": arguments.threads,
        "labs": {},
    }
    for name in chosen:
        record["labs"][name] = measure(labs[name], arguments.threads)
        print(name, json.dumps(record["labs"][name]), flush=True)
    arguments.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
