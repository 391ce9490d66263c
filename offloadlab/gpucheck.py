"""``make gpu-check``: prove the CUDA paths on a real GPU in one run, and keep the results.

On a CUDA machine it runs the GPU-marked tests, executes every chapter and lab with nbval on
the GPU, runs the link probe and every benchmark, writes each result as JSON with its
provenance into ``--out``, saves the probe as reference data in ``offloadlab/reference``
(``gpu-<name>.json``), and prints a one-screen summary last. Optional peers (torchao,
DeepSpeed, Accelerate) are used when installed and reported absent otherwise. Without a GPU
it says so in one line, runs the CPU parts (the benchmarks on the emulated link), and exits 0.

    python -m offloadlab.gpucheck [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import bench, ladder, machine, reference

BENCHMARKS = ("link", "overlap", "adam", "offload", "prefetch")
ROOT = Path(__file__).resolve().parent.parent  # the kit's checkout: tests/, book/, labs/
PEERS = ("torchao", "deepspeed", "accelerate")


def _run(title: str, command: list[str], log: Path) -> dict:
    """Run a command, keep its output in ``log``, and report how it ended."""
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    log.write_text(result.stdout + result.stderr, encoding="utf-8")
    tail = (result.stdout.strip().splitlines() or [""])[-1]
    return {"step": title, "ok": result.returncode == 0, "seconds": time.perf_counter() - started,
            "summary": re.sub(r"\x1b\[[0-9;]*m", "", tail)[:90], "log": str(log)}


def _pytest(title: str, args: list[str], log: Path) -> dict:
    return _run(title, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], log)


def run(out: Path, quick: bool = False) -> int:
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    provenance = machine.provenance()
    steps, results = [], {}
    if not gpu:
        print("no CUDA GPU on this machine: running the CPU parts; the GPU tests, the GPU notebook run "
              "and the reference measurement are skipped")
    if not (ROOT / "tests").is_dir():
        print(f"no tests/ beside the package ({ROOT}): run gpu-check from a checkout of the kit")
        return 2
    steps.append(_pytest("GPU-marked tests", ["-m", "gpu", "tests"], out.resolve() / "gpu-tests.log"))
    if gpu:
        steps.append(_pytest("chapters and labs on the GPU (nbval)", ["book", "labs"], out.resolve() / "notebooks.log"))
        measured = ladder.measure(quick=quick)
        records = [r.to_dict() for r in measured["records"]]
        (out / "probe.json").write_text(json.dumps({"machine": measured["machine"].to_dict(),
                                                    "ladder": ladder.of_machine(measured),
                                                    "records": records}, indent=1), encoding="utf-8")
        name = "gpu-" + re.sub(r"[^A-Za-z0-9]+", "-", provenance["gpu"] or "unknown").strip("-").lower()
        path = reference.save(name, "measured", provenance["gpu"], provenance, records, folder=reference.FOLDER,
                              overwrite=True)  # into the checkout, to be committed
        steps.append({"step": "link probe (reference data)", "ok": True, "seconds": 0.0,
                      "summary": f"{len(records)} records → {path.name}", "log": str(out / "probe.json")})
    for name in BENCHMARKS:
        started = time.perf_counter()
        try:
            results[name] = getattr(bench, name)(quick=quick)
        except Exception as error:  # one failing benchmark must not hide the others
            steps.append({"step": f"bench {name}", "ok": False, "seconds": time.perf_counter() - started,
                          "summary": f"{type(error).__name__}: {error}"[:90], "log": ""})
            continue
        (out / f"bench-{name}.json").write_text(json.dumps(results[name], indent=1), encoding="utf-8")
        if gpu:
            reference.save(f"bench-{name}-" + re.sub(r"[^A-Za-z0-9]+", "-", provenance["gpu"]).strip("-").lower(),
                           "measured", provenance["gpu"], provenance, [results[name]], folder=reference.FOLDER,
                           overwrite=True)
        steps.append({"step": f"bench {name} ({results[name]['source']})", "ok": True,
                      "seconds": time.perf_counter() - started, "summary": _headline(results[name]),
                      "log": str(out / f"bench-{name}.json")})
    peers = {p: importlib.util.find_spec(p) is not None for p in PEERS}
    summary = {"provenance": provenance, "steps": steps, "peers": peers}
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    _print_summary(summary)
    return 0 if all(s["ok"] for s in steps) else 1


def _headline(result: dict) -> str:
    """The first ratio of a benchmark, as a short line."""
    for name, value in result["ratios"].items():
        if value is not None:
            return f"{name}: {value:.2f}"
    return ""


def _print_summary(summary: dict) -> None:
    p = summary["provenance"]
    print(f"\ngpu-check on {p['gpu'] or 'no GPU'} (driver {p.get('driver') or '–'}), torch {p['torch']}, "
          f"{p['cpu']}, {p['date']}")
    for s in summary["steps"]:
        print(f"  {'ok  ' if s['ok'] else 'FAIL'} {s['step']:<42} {s['seconds']:6.1f} s  {s['summary']}")
    print("  peers: " + ", ".join(f"{k} {'present' if v else 'absent'}" for k, v in summary["peers"].items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m offloadlab.gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/gpu-check", help="folder for the JSON results and logs")
    parser.add_argument("--quick", action="store_true", help="smaller benchmarks")
    args = parser.parse_args(argv)
    return run(Path(args.out), quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
