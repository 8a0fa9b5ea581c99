"""Task files: the rows of a .jsonl, .parquet or saved Hugging Face `datasets` folder as a
random-access source of GRPO groups, the same kind of source as a suite's seeds
(`tiderl.envs.tasks.TaskSource`). No JAX; the run's grain pipeline (`tiderl.runtime.taskstream`) reads it.

Row g is group g: its `group_size` tasks are the row's fields plus the ids tiderl adds
(`task_id`, `group_id`, `member`, `split`, `suite`), and that dict is what the environment's
`/start` (or the reward function, or the agent) receives. A row's `id` field, when present,
names its group (`train/e0/<id>`); otherwise its index does (`train/e0/r<g>`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tiderl.configlib import ConfigError

RESERVED = ("task_id", "group_id", "member", "split", "suite", "epoch")
"""Task-spec fields tiderl sets; a row may not carry them."""
_EVAL_SPLITS = ("validation", "test", "eval")


def read_rows(path: str, *, key: str = "env.tasks", split: str = "train") -> list[dict]:
    """Every row of the task file at `path` as a dict; a ConfigError naming `key` when the
    file cannot be read or a row is not a JSON object / uses a reserved field name."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config key '{key}'={path!r}: no such file or folder")
    try:
        if p.is_dir():
            rows = _read_datasets(p, split)
        elif p.suffix == ".jsonl":
            rows = _read_jsonl(p)
        elif p.suffix == ".parquet":
            rows = _read_parquet(p)
        else:
            raise ValueError("use a .jsonl or .parquet file, or a folder written by "
                             "datasets' save_to_disk")
    except ConfigError:
        raise
    except (ValueError, OSError, ImportError) as e:
        raise ConfigError(f"config key '{key}'={path!r}: {e}") from e
    if not rows:
        raise ConfigError(f"config key '{key}'={path!r} holds no rows")
    ids: dict[str, int] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"config key '{key}'={path!r}: row {i} is a "
                              f"{type(row).__name__}, not an object")
        bad = [f for f in RESERVED if f in row]
        if bad:
            raise ConfigError(f"config key '{key}'={path!r}: row {i} has the field {bad[0]!r}, "
                              f"which tiderl sets itself ({', '.join(RESERVED)}); rename it")
        if "id" in row:
            rid = str(row["id"])
            if not rid or rid in ids:
                raise ConfigError(f"config key '{key}'={path!r}: row {i} has the id {rid!r} "
                                  + (f"of row {ids[rid]}" if rid in ids else "(empty)")
                                  + "; ids name groups and must be unique")
            ids[rid] = i
    return rows


def _read_jsonl(p: Path) -> list[Any]:
    rows = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"line {n} is not JSON ({e})") from None
    return rows


def _read_parquet(p: Path) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("reading .parquet needs pyarrow: pip install pyarrow") from e
    return pq.read_table(p).to_pylist()


def _read_datasets(p: Path, split: str) -> list[Any]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError("a datasets folder needs the datasets package: pip install "
                          "'tiderl[datasets]' (or pip install datasets)") from e
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        names = [split] if split == "train" else [s for s in _EVAL_SPLITS if s in ds]
        if not names or names[0] not in ds:
            raise ValueError(f"the DatasetDict has splits {sorted(ds)}, none of "
                             f"{[split] if split == 'train' else list(_EVAL_SPLITS)}")
        ds = ds[names[0]]
    return [dict(r) for r in ds]


class FileSource:
    """Random-access groups of one split of a task file (grain's RandomAccessDataSource)."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], split: str, *, group_size: int,
                 suite: str, path: str = ""):
        if group_size <= 0:
            raise ValueError(f"group_size={group_size} must be positive; set env.group_size")
        self.rows, self.split, self.group_size = list(rows), split, group_size
        self.suite, self.path = suite, path
        self.groups = len(self.rows)

    def __len__(self) -> int:
        return self.groups

    def __getitem__(self, g: int) -> dict[str, Any]:
        return self.group(g, epoch=0)

    def __repr__(self) -> str:
        return f"FileSource({self.path!r}, {self.split!r}, rows={self.groups})"

    def group(self, g: int, *, epoch: int) -> dict[str, Any]:
        """Row g as a group of `group_size` task specs (ids carry the epoch: unique)."""
        if not 0 <= g < self.groups:
            raise IndexError(f"row {g} out of range 0..{self.groups - 1}")
        row = self.rows[g]
        rid = str(row["id"]) if "id" in row else f"r{g}"
        group_id = f"{self.split}/e{epoch}/{rid}"
        tasks = [{**row, "task_id": f"{group_id}/m{m}", "group_id": group_id, "member": m,
                  "split": self.split, "suite": self.suite} for m in range(self.group_size)]
        return {"group_id": group_id, "split": self.split, "suite": self.suite, "epoch": epoch,
                "row": g, "tasks": tasks}


def check_chat_rows(rows: Sequence[Mapping[str, Any]], key: str, path: str) -> None:
    """Single-turn rows carry `prompt` (text) or `messages` (a chat: role/content objects)."""
    for i, row in enumerate(rows):
        if isinstance(row.get("prompt"), str):
            continue
        msgs = row.get("messages")
        if isinstance(msgs, list) and msgs and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
            continue
        raise ConfigError(f"config key '{key}'={path!r}: row {i} has neither 'prompt' (text) nor "
                          "'messages' (a list of {role, content}); a single-turn task needs one "
                          "(or set env.suite to an adapter that reads the row)")
