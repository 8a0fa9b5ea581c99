"""The controller's rollout side: groups from the task stream to the readiness buffer. No JAX.

Groups regenerated on resume come first, then the stream; each group remembers its stream
position (`Controller.data_state`) and plays in an asyncio task of its own
(`RolloutManager.run_group`) that ends with the group in the buffer (trainable) or counted
dropped; a failure there stops the run with that error. The producer keeps rollout busy within
the staleness bound (modes tiderl, async, stream); `sync` mode rolls out one step's worth
instead, then stops. A mixin so the loop in `controller.py` stays about the loop; it reads the
controller's state (`cfg`, `stream`, `manager`, `buffer`, `starvation`, `in_flight`,
`index_of`, ...) and calls its waits (`_wait`, `_warn_if_starved`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

# The controller's logger: these are the controller's messages (as in `starvation.py`).
log = logging.getLogger("tiderl.control.controller")


class Producing:
    """The groups' start, play and end, and the staleness throttle (see the module docstring)."""

    cfg: Any
    stream: Any
    manager: Any
    buffer: Any
    starvation: Any
    step: int
    _step0: int
    _regen: list[int]
    _exhausted: bool
    index_of: dict[str, int]
    in_flight: set[str]
    started_groups: int
    generated_tokens: int
    rwt: float
    _changed: asyncio.Event
    _ready: asyncio.Event
    _bg: set[asyncio.Task[Any]]
    _stop: bool
    _fatal: BaseException | None
    now: Callable[[], float]
    """The controller's clock (`Controller.now`)."""

    def _next_group(self) -> dict | None:
        """Regenerated groups first (resume), then the stream; each remembers its position."""
        if self._regen:
            k = self._regen.pop(0)
            g = self.stream.element(k)
        else:
            k = self.stream.position
            try:
                g = next(self.stream)
            except StopIteration:
                self._exhausted = True
                return None
        self.index_of[g["group_id"]] = k
        return g

    def _start_group(self, group: dict) -> None:
        gid = group["group_id"]
        self.in_flight.add(gid)
        self.started_groups += 1
        t = asyncio.create_task(self._run_group(group), name=f"group:{gid}")
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _run_group(self, group: dict) -> None:
        """Plays a group, then it is trained (ready) or dropped (counted); a failure anywhere
        in between stops the run with that error, never leaves the group in neither state."""
        try:
            trajs = await self.manager.run_group(group)
            self.in_flight.discard(group["group_id"])
            self.generated_tokens += sum(t.action_token_count for t in trajs)
            trainable = self.buffer.add_group(trajs, now=self.now()) is not None
            self.starvation.group_ended(trajs, trainable, self.now())
        except Exception as e:  # no rollout rank left, or a bug: stop the run, loudly
            log.error("group %s: %s: %s; the run stops", group.get("group_id"),
                      type(e).__name__, e)
            self._fatal = self._fatal or e
            raise
        finally:
            self._ready.set()
            self._changed.set()

    def _throttled(self) -> bool:
        """Staleness throttle (AReaL's rule): groups started, less those dropped without
        training (failed, zero variance, stale), may not run more than `max_staleness` steps
        ahead of the trainer."""
        live = self.started_groups - sum(self.buffer.dropped.values())
        steps_done = self.step - self._step0
        return live >= (steps_done + 1 + self.cfg.max_staleness) * self.cfg.groups_per_step

    async def _produce(self) -> None:
        """Keeps rollout busy within the staleness bound (modes tiderl, async, stream)."""
        while not self._stop:
            if self._throttled():
                t0 = self.now()
                idle = not self.in_flight
                self._changed.clear()
                await self._changed.wait()
                if idle:
                    self.rwt += self.now() - t0
                continue
            group = self._next_group()
            if group is None:
                return
            self._start_group(group)
            await asyncio.sleep(0)

    async def _sync_rollout(self) -> None:
        """`sync` mode's rollout phase: start groups until a step's worth is ready (groups that
        are dropped — failed, zero variance — are replaced), then stop; nothing trains
        meanwhile and nothing rolls out while training."""
        self.starvation.begin_wait(self.now())
        while len(self.buffer) < self.cfg.groups_per_step:
            missing = self.cfg.groups_per_step - len(self.buffer) - len(self.in_flight)
            for _ in range(max(0, missing)):
                g = self._next_group()
                if g is None:
                    break
                self._start_group(g)
            if not self.in_flight:
                return  # the stream ran out
            self._ready.clear()
            await self._wait(self._ready, starving=True)
            if self._fatal is not None:
                raise self._fatal
            self._warn_if_starved()
        while self.in_flight and self._fatal is None:  # a step's rollout ends only when all its episodes have
            self._ready.clear()
            await self._wait(self._ready)
