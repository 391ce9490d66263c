"""Timelines as Chrome trace files, to open in Perfetto (ui.perfetto.dev) or chrome://tracing.

Every timeline offloadlab records — a link's copies, a prefetcher's pass, an offloaded optimizer
step, an overlap experiment — has the same shape: ``{lane: [(start, end, label), ...]}`` with times
in seconds on the recording link's clock. :func:`chrome_trace` turns that into the JSON trace
format ``torch.profiler`` exports (complete events, ``"ph": "X"``, microseconds), one named track
per lane, so a reader can open it beside a ``torch.profiler`` trace of the same step.
:func:`profiler_lines_silenced` keeps the lines ``torch.profiler`` prints at each start and stop
out of a notebook.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path

from . import files

__all__ = ["chrome_trace", "write_chrome_trace", "profiler_lines_silenced"]


def chrome_trace(lanes: dict, process: str = "offloadlab") -> dict:
    """The Chrome trace of ``lanes`` ({lane: [(start_s, end_s, label)]}) as a JSON-ready dict."""
    if not isinstance(lanes, dict):
        raise ValueError(
            "lanes: expected a dict of lane name -> [(start, end, label)]; got "
            f"{type(lanes).__name__}"
        )
    events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": process}}]
    for track, (lane, intervals) in enumerate(lanes.items()):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": track, "args": {"name": str(lane)}}
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": 0,
                "tid": track,
                "args": {"sort_index": track},
            }
        )
        if not isinstance(intervals, (list, tuple)):
            raise ValueError(
                f"lanes: lane {lane!r}: expected a list of (start, end, label); got "
                f"{type(intervals).__name__}"
            )
        for number, interval in enumerate(intervals):
            start, end, label = _interval(lane, number, interval)
            events.append(
                {
                    "name": str(label) or str(lane),
                    "cat": str(lane),
                    "ph": "X",
                    "pid": 0,
                    "tid": track,
                    "ts": start * 1e6,
                    "dur": (end - start) * 1e6,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _interval(lane, number: int, interval) -> tuple[float, float, object]:
    """(start, end, label) of one interval, its times as finite floats (numpy's and one-value
    tensors too), end ≥ start; else ValueError naming the lane and the interval."""
    where = f"lanes: lane {lane!r} interval {number}"
    if not isinstance(interval, (list, tuple)) or len(interval) != 3:
        raise ValueError(f"{where}: expected (start, end, label); got {interval!r}")
    start, end, label = interval
    try:
        start, end = float(start), float(end)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{where}: expected times in seconds; got ({start!r}, {end!r})") from None
    if not (math.isfinite(start) and math.isfinite(end)):
        raise ValueError(f"{where}: expected finite times; got ({start}, {end})")
    if not end >= start:
        raise ValueError(f"{where}: expected end ≥ start; got ({start}, {end})")
    return start, end, label


def write_chrome_trace(lanes: dict, path, process: str = "offloadlab") -> Path:
    """Write :func:`chrome_trace` of ``lanes`` to ``path`` atomically (a complete file or none),
    replacing a file there (a notebook cell run again writes its trace anew) but never writing
    through a link planted at ``path``; a new file gets the mode ``open()`` would give it."""
    payload = json.dumps(chrome_trace(lanes, process), allow_nan=False)
    return files.write_atomically(path, payload, replace=True, follow=False)


@contextlib.contextmanager
def profiler_lines_silenced():
    """Native standard error (file descriptor 2) goes to the null device meanwhile.

    ``torch.profiler`` writes a line to it at each start and stop ("USDT:<date> <pid>:<tid>
    SyncActivityProfilerHandler.cpp:52] profiler_start"), below Python, where Jupyter shows it in
    red under the cell and a built page keeps the build machine's date and process id. Python's
    own ``sys.stderr`` is flushed first and is not touched."""
    sys.stderr.flush()
    kept = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(kept, 2)
        os.close(kept)
