"""Task sources of the built-in suites: random-access GRPO groups drawn from seeds. No JAX.

A group is `{"group_id", "split", "suite", "epoch", "env_seed", "tasks": [task spec] *
group_size}`; each task spec is what `/start` receives: `task_id`, `group_id`, `member`,
`split`, `suite`, the suite-specific `seed`, and the suite's own fields.

`TaskSource` is a random-access source (grain's RandomAccessDataSource protocol: `len`,
`[g]`), the same kind as a task file (`tiderl.envs.taskfile.FileSource`). The order a run
plays them in — shuffling per epoch, epochs, sharding by process, the checkpointable iterator —
is the grain pipeline of `tiderl.runtime.taskstream`, used by every run.

Train and eval seeds are disjoint by construction: env_seed = task_seed + 2*g (+1 for eval).
"""

from __future__ import annotations

from collections.abc import Mapping
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
        return cls(cfg.suite_name, split, groups=groups, group_size=cfg.group_size,
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

    def element(self, k: int) -> dict[str, Any]:
        """Group k % groups in epoch k // groups, unshuffled (tests and benchmarks; a run's
        order comes from its grain pipeline)."""
        epoch, g = divmod(k, self.groups)
        return self.group(g, epoch=epoch)


def system_prompt(cfg: EnvConfig) -> str | None:
    """The system turn the run's env suite asks for under env.options (Adapter.system_prompt),
    None for task kinds without a suite (single-turn task files, agents) or a suite without
    one."""
    if cfg.kind != "env":
        return None
    return adapter_class(cfg.suite_name).system_prompt(cfg.option_dict())


def eval_tasks(cfg: EnvConfig) -> list[dict[str, Any]]:
    """Every eval task spec of the suite, in order (the eval split is small and run whole)."""
    src = TaskSource.from_config(cfg, "eval")
    return [t for g in range(len(src)) for t in src[g]["tasks"]]
