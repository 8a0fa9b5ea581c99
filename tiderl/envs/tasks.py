"""Task sources: deterministic, shardable, checkpointable streams of task groups. No JAX here.

A stream element is one GRPO group: `{"group_id", "split", "suite", "epoch", "env_seed",
"tasks": [task spec] * group_size}`; each task spec is what `/start` receives: `task_id`,
`group_id`, `member`, `split`, `suite`, the suite-specific `seed`, and the suite's own fields.

Element k of the (unsharded) stream is a pure function of k: epoch k // groups, and within an
epoch the train split is a seeded permutation of its groups (the eval split keeps its order and
runs one epoch). Shard s of S takes elements s, s+S, s+2S, ... so shards are disjoint and cover
the stream, and the iterator state is just the next position (a JSON-able dict).

Two iterators give the same elements: `grain_iterator` (a grain `DatasetIterator`, for the
trainer: orbax checkpoints it with `grain.checkpoint.CheckpointSave`) and `TaskStream`
(pure Python, for JAX-free code such as the simulator). `import grain` imports JAX, so grain is
imported lazily inside `grain_dataset`; the rest of this module stays JAX-free.

Train and eval seeds are disjoint by construction: env_seed = task_seed + 2*g (+1 for eval).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from tiderl.envs.config import EnvConfig
from tiderl.envs.suites import adapter_class

Split = Literal["train", "eval"]
_MAX_SEED = (1 << 31) - 1  # TextWorld/TextArena take 31-bit seeds


class TaskSource:
    """Random-access groups of one split (grain's RandomAccessDataSource protocol)."""

    def __init__(self, suite: str, split: Split, *, groups: int, group_size: int,
                 task_seed: int = 0, options: Mapping[str, str] | None = None):
        if split not in ("train", "eval"):
            raise ValueError(f"split {split!r} must be 'train' or 'eval'")
        if groups <= 0 or group_size <= 0:
            raise ValueError(f"groups={groups} and group_size={group_size} must be positive; "
                             "set env.train_groups/env.eval_groups/env.group_size")
        if not 0 <= task_seed or task_seed + 2 * groups + 1 > _MAX_SEED:
            raise ValueError(f"task_seed={task_seed} + 2*groups={2 * groups} exceeds 31-bit "
                             "seeds; lower env.task_seed or the number of groups")
        self.suite, self.split = suite, split
        self.groups, self.group_size = groups, group_size
        self.task_seed = task_seed
        self.options = dict(options or {})
        self._fields = adapter_class(suite).task_fields

    @classmethod
    def from_config(cls, cfg: EnvConfig, split: Split) -> TaskSource:
        groups = cfg.train_groups if split == "train" else cfg.eval_groups
        return cls(cfg.suite, split, groups=groups, group_size=cfg.group_size,
                   task_seed=cfg.task_seed, options=cfg.option_dict())

    def __len__(self) -> int:
        return self.groups

    def __repr__(self) -> str:
        return (f"TaskSource({self.suite!r}, {self.split!r}, groups={self.groups}, "
                f"group_size={self.group_size}, task_seed={self.task_seed})")

    def env_seed(self, g: int) -> int:
        """The suite seed of group g: even offsets for train, odd for eval, never shared."""
        return self.task_seed + 2 * g + (self.split == "eval")

    def __getitem__(self, g: int) -> dict[str, Any]:
        return self.group(g, epoch=0)

    def group(self, g: int, *, epoch: int) -> dict[str, Any]:
        """Group g of the split as seen in `epoch` (ids carry the epoch, so they stay unique)."""
        if not 0 <= g < self.groups:
            raise IndexError(f"group {g} out of range 0..{self.groups - 1}")
        env_seed = self.env_seed(g)
        group_id = f"{self.split}/e{epoch}/g{g}"
        fields = self._fields(env_seed, self.options)
        tasks = [{**fields, "task_id": f"{group_id}/m{m}", "group_id": group_id, "member": m,
                  "split": self.split, "suite": self.suite}
                 for m in range(self.group_size)]
        return {"group_id": group_id, "split": self.split, "suite": self.suite,
                "epoch": epoch, "env_seed": env_seed, "tasks": tasks}

    @functools.lru_cache(maxsize=2)  # noqa: B019 - a source lives as long as its streams
    def _order(self, epoch: int) -> tuple[int, ...]:
        order = list(range(self.groups))
        if self.split == "train":
            random.Random(f"tiderl-tasks/{self.task_seed}/{epoch}").shuffle(order)
        return tuple(order)

    def element(self, k: int) -> dict[str, Any]:
        """Element k of the unsharded stream."""
        epoch, pos = divmod(k, self.groups)
        return self.group(self._order(epoch)[pos], epoch=epoch)

    def epochs(self, num_epochs: int | None) -> int:
        """Epochs a stream runs: eval runs once; train `num_epochs` or (None) ~forever."""
        if self.split == "eval":
            return 1
        return num_epochs if num_epochs is not None else (1 << 40) // self.groups


def _check_shard(shard_index: int, shard_count: int) -> None:
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index={shard_index} must be in 0..{shard_count - 1}")


def grain_dataset(source: TaskSource, *, shard_index: int = 0, shard_count: int = 1,
                  num_epochs: int | None = None):
    """A `grain.MapDataset` of this shard's groups, in stream order."""
    import grain  # imports JAX: keep it out of module import

    _check_shard(shard_index, shard_count)
    total = source.groups * source.epochs(num_epochs)
    return grain.MapDataset.range(shard_index, total, shard_count).map(source.element)


def grain_iterator(source: TaskSource, *, shard_index: int = 0, shard_count: int = 1,
                   num_epochs: int | None = None):
    """A checkpointable grain `DatasetIterator` over this shard's groups."""
    ds = grain_dataset(source, shard_index=shard_index, shard_count=shard_count,
                       num_epochs=num_epochs)
    return iter(ds.to_iter_dataset())


class TaskStream(Iterator[dict[str, Any]]):
    """JAX-free iterator equal to `grain_iterator`, with the same `{"next_index": j}` state."""

    def __init__(self, source: TaskSource, *, shard_index: int = 0, shard_count: int = 1,
                 num_epochs: int | None = None):
        _check_shard(shard_index, shard_count)
        self.source = source
        self.shard_index, self.shard_count = shard_index, shard_count
        self.total = source.groups * source.epochs(num_epochs)
        self.next_index = 0

    def __next__(self) -> dict[str, Any]:
        k = self.shard_index + self.next_index * self.shard_count
        if k >= self.total:
            raise StopIteration
        self.next_index += 1
        return self.source.element(k)

    def get_state(self) -> dict[str, int]:
        return {"next_index": self.next_index}

    def set_state(self, state: Mapping[str, Any]) -> None:
        index = state.get("next_index")
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"task stream state {dict(state)!r} needs a non-negative integer "
                             "'next_index' (from get_state())")
        self.next_index = index


def eval_tasks(cfg: EnvConfig) -> list[dict[str, Any]]:
    """Every eval task spec, in order (the eval split is small and run whole)."""
    return [t for grp in TaskStream(TaskSource.from_config(cfg, "eval")) for t in grp["tasks"]]
