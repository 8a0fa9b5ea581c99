"""The run's task stream: a grain pipeline over a random-access task source. [JAX: grain imports
it; the controller sees only the plain `TaskStreamPort` protocol.]

Every run plays its tasks through this pipeline, whatever their source — a built-in suite's
seeds (`tiderl.envs.tasks.TaskSource`) or a task file (`tiderl.envs.taskfile.FileSource`):

    grain.MapDataset.range(groups)
        .shuffle(seed)            # train split, env.shuffle: grain draws a new order each epoch
        .repeat(epochs)           # env.epochs (None: until the run ends)
        .map_with_index(source.group(g, epoch=k // groups))
        [shard_index::shard_count]

so element k of a shard is a pure function of k: a group in flight at a checkpoint is
regenerated on resume by position (`element(k)`), and the iterator state — grain's own
`get_state()` plus the position — goes into the orbax checkpoint's metadata (JSON). A resumed
run continues mid-epoch exactly where the checkpoint was.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

import grain

from tiderl.envs.config import EnvConfig
from tiderl.envs.taskfile import FileSource, check_chat_rows, read_rows
from tiderl.envs.tasks import TaskSource

log = logging.getLogger(__name__)


class GroupSource(Protocol):
    groups: int

    def __len__(self) -> int: ...

    def group(self, g: int, *, epoch: int) -> dict[str, Any]: ...


def group_dataset(source: GroupSource, *, shuffle: bool, seed: int = 0,
                  num_epochs: int | None = None, shard_index: int = 0, shard_count: int = 1
                  ) -> grain.MapDataset:
    """This shard's groups as a `grain.MapDataset`, in stream order."""
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index={shard_index} must be in 0..{shard_count - 1}")
    n = len(source)
    ds = grain.MapDataset.range(n)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    ds = ds.map_with_index(lambda k, g: source.group(int(g), epoch=k // n))
    return ds[shard_index::shard_count]


class GrainTaskStream:
    """A checkpointable iterator of groups over `group_dataset` (the controller's stream)."""

    def __init__(self, source: GroupSource, *, shuffle: bool, seed: int = 0,
                 num_epochs: int | None = None, shard_index: int = 0, shard_count: int = 1):
        self.source = source
        self.dataset = group_dataset(source, shuffle=shuffle, seed=seed, num_epochs=num_epochs,
                                     shard_index=shard_index, shard_count=shard_count)
        self._it = self._iterator()
        self.position = 0
        """Index (within this shard) of the next group `next()` returns."""

    def _iterator(self) -> grain.DatasetIterator:
        # No read-ahead threads: a group is a small dict built on demand, and reading ahead
        # would only make the iterator state trail what the controller has taken.
        return iter(self.dataset.to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))

    def __iter__(self) -> GrainTaskStream:
        return self

    def __next__(self) -> dict[str, Any]:
        g = next(self._it)  # StopIteration after the last epoch
        self.position += 1
        return g

    def __len__(self) -> int:
        return len(self.dataset)

    def element(self, k: int) -> dict[str, Any]:
        """Group k of this shard (random access: regenerating groups on resume)."""
        return self.dataset[k]

    def get_state(self) -> dict[str, Any]:
        return {"position": self.position, "grain": self._it.get_state()}

    def set_state(self, state: Mapping[str, Any]) -> None:
        pos = state.get("position", state.get("next_index"))
        if not isinstance(pos, int) or pos < 0:
            raise ValueError(f"task stream state {dict(state)!r} needs a non-negative integer "
                             "'position' (from get_state())")
        self._it = self._iterator()
        self._it.set_state(state.get("grain") or {"next_index": pos})
        self.position = pos


def sources(cfg: EnvConfig) -> tuple[GroupSource, GroupSource | None]:
    """(train, eval) sources of the run: task files when env.tasks is set, else the suite's
    seeds. No eval source when a task file has no env.eval_tasks."""
    kind = cfg.kind
    suite = {"env": cfg.suite_name, "single_turn": "single_turn", "agent": "agent"}[kind]
    if not cfg.tasks:
        if kind == "single_turn":  # unreachable through EnvConfig.kind; kept as a guard
            raise ValueError("single-turn tasks need env.tasks")
        if kind == "agent":
            return _seeds(cfg, "train", suite), _seeds(cfg, "eval", suite)
        return TaskSource.from_config(cfg, "train"), TaskSource.from_config(cfg, "eval")
    out = []
    for key, split in (("env.tasks", "train"), ("env.eval_tasks", "eval")):
        path = cfg.tasks if split == "train" else cfg.eval_tasks
        if not path:
            out.append(None)
            continue
        rows = read_rows(path, key=key, split=split)
        if split == "eval":
            rows = rows[:cfg.eval_groups]
        if kind == "single_turn":
            check_chat_rows(rows, key, path)
        out.append(FileSource(rows, split, group_size=cfg.group_size, suite=suite, path=path))
    return out[0], out[1]


def _seeds(cfg: EnvConfig, split: str, suite: str) -> TaskSource:
    """Seeds for agent tasks that bring no task file (each task carries its `seed`)."""
    src = TaskSource.from_config(cfg, split)  # type: ignore[arg-type]
    src.suite = suite
    return src


def task_streams(cfg: EnvConfig, data_state: Mapping[str, Any] | None = None
                 ) -> tuple[GrainTaskStream, list[dict[str, Any]]]:
    """The run's train stream (restored to `data_state`, a checkpoint's) and its eval groups.

    One controller feeds every rollout rank, so the run reads one shard (0 of 1); the pipeline
    shards by process for setups that run one stream per process."""
    train, evals = sources(cfg)
    stream = GrainTaskStream(train, shuffle=cfg.shuffle, seed=cfg.task_seed,
                             num_epochs=cfg.epochs or None)
    if data_state:
        state = data_state.get("stream") or {"next_index": int(data_state.get("next_index", 0))}
        stream.set_state(state)
    eval_groups = []
    if evals is not None:
        eval_ds = group_dataset(evals, shuffle=False, num_epochs=1)
        eval_groups = [eval_ds[k] for k in range(len(eval_ds))]
    log.info("tasks: %s (%d groups of %d%s), eval: %s", getattr(train, "path", "") or train,
             len(train), cfg.group_size, ", shuffled each epoch" if cfg.shuffle else "",
             f"{len(eval_groups)} groups" if eval_groups else "none")
    return stream, eval_groups
