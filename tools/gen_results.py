"""Generate docs/results.md from the benchmark records in benchmarks/results/*.json.

    python tools/gen_results.py            # rewrite docs/results.md
    python tools/gen_results.py --check    # exit 1 if it is out of date

Each record is one JSON object:

    {"benchmark": "benchmarks/ctb_sched.py", "command": "python benchmarks/ctb_sched.py",
     "machine": "...", "commit": "ab6d34f", "date": "2026-12-04", "figures": {...}}

written by `python tools/record_benchmark.py NAME -- COMMAND` (the benchmark's last stdout
line is `figures`). Optional keys: `title`, `dirty` (uncommitted changes in the tree it ran
on), `wall_s`, `load_before` (the machine's 1-minute load average when it started), `source`
(where figures come from when they were not recorded by the tool, e.g. an earlier README),
`notes` (a list of sentences without figures: what the benchmark's setting cannot show),
`paper` (the paper's figures for the same experiment, arXiv 2608.10402) and `image` (a plot the
command wrote, copied under docs/, path relative to docs/). Every figure on the
page is read from these files: none is typed into the page by hand.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "results.md"
REGENERATE = "python tools/gen_results.py"
REQUIRED = ("benchmark", "command", "machine", "commit", "date", "figures")


def load(results: Path = RESULTS) -> list[tuple[str, dict]]:
    out = []
    for path in sorted(results.glob("*.json")):
        rec = json.loads(path.read_text())
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}")
        if not isinstance(rec["figures"], dict):
            raise ValueError(f"{path}: 'figures' must be an object")
        out.append((path.stem, rec))
    return out


def flatten(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            rows += flatten(v, key + ".")
        else:
            rows.append((key, v))
    return rows


def _scalar(v: object) -> bool:
    return not isinstance(v, dict)


def _matrix(title: str, rows: list[tuple[str, dict]]) -> list[str]:
    inner = {c for _, d in rows for c in d}
    if len(inner) > len(rows) and len(inner) > 6:  # many figures per case: cases as columns
        names = [n for n, _ in rows]
        order = list(dict.fromkeys(c for _, d in rows for c in d))
        by = dict(rows)
        rows = [(c, {n: by[n].get(c) for n in names}) for c in order]
    cols: list[str] = []
    for _, d in rows:
        cols += [c for c in d if c not in cols]
    out = ["", f"| {_cell(title)} | " + " | ".join(f"`{c}`" for c in cols) + " |",
           "| --- |" + " --- |" * len(cols)]
    for name, d in rows:
        out.append(f"| `{name}` | " + " | ".join(fmt(d.get(c)) for c in cols) + " |")
    return out


def figure_tables(figures: dict, value_head: str = "value") -> list[str]:
    """The figures as tables: a figure holding one dict per case (`{"sync": {"real": .., "sim":
    ..}, ...}`) is a matrix of its own; figures that are dicts over the same keys (per size, per
    mode) share one matrix; everything else is a row of the main table, nested keys dotted."""
    main: list[tuple[str, object]] = []
    groups: dict[tuple[str, ...], list[tuple[str, dict]]] = {}
    tables: list[str] = []
    for k, v in figures.items():
        if isinstance(v, dict) and v and all(isinstance(x, dict) and x and all(
                _scalar(y) for y in x.values()) for x in v.values()):
            tables += _matrix(k, list(v.items()))
        elif isinstance(v, dict) and v and all(_scalar(x) for x in v.values()):
            groups.setdefault(tuple(v), []).append((k, v))
        elif isinstance(v, dict) and v:
            main += flatten(v, k + ".")
        else:
            main.append((k, v))
    for members in groups.values():
        if len(members) > 1:
            tables += _matrix("figure", members)
        else:
            main += flatten(members[0][1], members[0][0] + ".")
    out = []
    if main:
        out += ["", f"| figure | {value_head} |", "| --- | --- |"]
        out += [f"| `{k}` | {fmt(v)} |" for k, v in main]
    return out + tables


def duration(s: float) -> str:
    if s < 120:
        return f"{s:g} s"
    m, sec = divmod(round(s), 60)
    return f"{m} min {sec} s" if sec else f"{m} min"


def fmt(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if v is None:
        return "—"
    if isinstance(v, list):
        return ", ".join(fmt(x) for x in v)
    return _cell(str(v))


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def summary(benchmark: str) -> str:
    """The first line of the benchmark script's docstring (what it measures)."""
    path = ROOT / benchmark
    if path.suffix == ".py" and path.is_file():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        return " ".join(doc.split("\n\n")[0].split())
    return ""


def provenance(rec: dict) -> str:
    commit = rec["commit"]
    if commit:
        text = f"`{commit}`" + (" (with uncommitted changes in the tree)" if rec.get("dirty")
                                else "")
    else:
        text = "not recorded"
    return text


def render(results: Path = RESULTS) -> str:
    records = load(results)
    lines = [
        "# Results",
        "",
        f"<!-- Generated by `{REGENERATE}` from benchmarks/results/*.json; do not edit by "
        "hand. -->",
        "",
        "Every figure below is read from a benchmark record in `benchmarks/results/`, with the "
        "command that produced it, the machine and the commit it ran on, and the date. To "
        "measure again and refresh a record:",
        "",
        "```bash",
        "python tools/record_benchmark.py NAME -- python benchmarks/SCRIPT.py [options]",
        f"{REGENERATE}                      # then re-render this page",
        "```",
        "",
        "On a CPU the fake JAX devices are slices of the same cores, so read ratios as what "
        "scheduling changes (idle time, recomputation, model swaps), not as GPU speedups. "
        "Records with a *source* row were transcribed from an earlier README: their commit is "
        "the one that added the figures to it (they were measured on that build or the one just "
        "before), and their machine is described as that README described it.",
        "",
        "| record | benchmark | date | commit |",
        "| --- | --- | --- | --- |",
    ]
    for name, rec in records:
        title = rec.get("title") or name
        lines.append(f"| [{_cell(title)}](#{name.replace('_', '-')}) | `{rec['benchmark']}` | "
                     f"{rec['date']} | {provenance(rec)} |")
    for name, rec in records:
        title = rec.get("title") or name
        lines += ["", f"## {_cell(title)} {{#{name.replace('_', '-')}}}", ""]
        about = summary(rec["benchmark"])
        if about:
            lines += [_cell(about), ""]
        lines += [
            "```bash",
            rec["command"],
            "```",
            "",
            "| | |",
            "| --- | --- |",
            f"| machine | {_cell(rec['machine'])} |",
            f"| commit | {provenance(rec)} |",
            f"| date | {rec['date']} |",
        ]
        if rec.get("wall_s") is not None:
            lines.append(f"| wall time | {duration(rec['wall_s'])} |")
        if rec.get("load_before") is not None:
            lines.append(f"| load average at start | {fmt(rec['load_before'])} |")
        if rec.get("source"):
            lines.append(f"| source | {_cell(rec['source'])} |")
        lines += figure_tables(rec["figures"])
        if rec.get("paper"):
            lines += ["", "The paper's figures for the same experiment (arXiv 2608.10402):"]
            lines += figure_tables(rec["paper"], value_head="paper")
        if rec.get("image"):
            lines += ["", f"![{_cell(title)}]({rec['image']})"]
        for note in rec.get("notes") or ():
            lines += ["", _cell(note)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"{args.out} is out of date: run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
