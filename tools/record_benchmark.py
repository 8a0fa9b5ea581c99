"""Run one benchmark and keep its figures: `benchmarks/results/NAME.json`.

    python tools/record_benchmark.py NAME -- python benchmarks/ctb_sched.py --repeats 3

Runs the command from the repository root, echoes its output, takes its last stdout line
(every benchmark ends with one JSON object) as the figures, and writes them with the command,
the machine, the commit and the date; an existing record's `title`, `paper`, `notes` and
`image` are kept. `python tools/gen_results.py` then renders the results page
(docs/results.md) from every file there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# Keys of an existing record that a new measurement keeps (they are not the benchmark's output).
KEPT = ("title", "paper", "notes", "image")


def machine() -> str:
    """CPU model and core count (and an accelerator when JAX is not asked: see --machine)."""
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or platform.machine()}, {os.cpu_count()} cores, {platform.system()}"


def commit() -> tuple[str, bool]:
    """(short HEAD, whether the working tree had uncommitted changes to tracked files)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return head, dirty


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", help="result name: benchmarks/results/NAME.json")
    p.add_argument("--benchmark", help="what ran (default: the script the command names)")
    p.add_argument("--machine", help="override the machine description (e.g. the GPU's)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the benchmark command")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("give the benchmark command after --")
    head, dirty = commit()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    wall = time.monotonic() - t0
    sys.stdout.write(proc.stdout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        print(f"record_benchmark: {shlex.join(cmd)} exited {proc.returncode}; nothing recorded",
              file=sys.stderr)
        return 1
    try:
        figures = json.loads(lines[-1])
    except json.JSONDecodeError:
        print("record_benchmark: the last stdout line is not one JSON object; nothing recorded",
              file=sys.stderr)
        return 1
    shown = [("python" if c == sys.executable else c) for c in cmd]
    bench = args.benchmark or next((c for c in shown if c.endswith(".py") or c.startswith(
        "tiderl.")), shown[0])
    record = {
        "benchmark": bench,
        "command": shlex.join(shown),
        "machine": args.machine or machine(),
        "commit": head,
        "dirty": dirty,
        "date": datetime.date.today().isoformat(),
        "wall_s": round(wall, 1),
        "load_before": round(load, 2) if load is not None else None,
        "figures": figures,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name}.json"
    if out.is_file():  # what a person added to the record (the paper's figures, notes) stays
        old = json.loads(out.read_text())
        record.update({k: old[k] for k in KEPT if k in old})
    out.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    print(f"record_benchmark: wrote {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
