"""Device time of pipelined phases, measured by completion without blocking the dispatcher.

In decoupled RA2P the worker dispatches Ref forward i, Actor forward i and backward i and moves
on (async dispatch): timing the calls measures dispatch, not compute, and blocking after each
would serialise the very pipeline being measured. Here a watcher thread waits for each phase's
outputs instead. Devices run one lane's work in dispatch order, so a phase's busy time is its
completion minus the later of its dispatch, the previous completion on its lane and the
completion of what it waited on (the backward waits for the Ref logprobs).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from typing import Any

import jax


class PhaseClock:
    """Busy seconds per phase, from completion times (see the module docstring). One watcher
    thread per lane, so one lane's slow phase never delays noting another lane's completion."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._lanes: dict[str, queue.Queue] = {}
        self._busy: defaultdict[str, float] = defaultdict(float)
        self._done: dict[Any, float] = {}
        self._lane_end: dict[str, float] = {}

    def track(self, lane: str, phase: str, out: Any, *, key: Any = None,
              after: Any = None) -> None:
        """`out` is what phase `phase` (on `lane`) returns; `after` is the key of a tracked
        phase on another lane that it waited for. Never blocks."""
        q = self._lanes.get(lane)
        if q is None:
            q = self._lanes[lane] = queue.Queue()
            threading.Thread(target=self._run, args=(lane, q), name=f"tiderl-clock-{lane}",
                             daemon=True).start()
        q.put((phase, out, key, after, time.perf_counter()))

    def collect(self) -> dict[str, float]:
        """Waits for everything tracked so far; returns busy seconds per phase and resets."""
        for q in list(self._lanes.values()):
            q.join()
        with self._cv:
            out, self._busy = dict(self._busy), defaultdict(float)
            self._done.clear()
            self._lane_end.clear()
        return out

    def _run(self, lane: str, q: queue.Queue) -> None:
        while True:
            phase, out, key, after, t_disp = q.get()
            try:
                jax.block_until_ready(out)
            except Exception:  # noqa: BLE001 - the step's own path reports device errors
                pass
            t = time.perf_counter()
            with self._cv:
                if after is not None:  # finished before us (a data dependency): noted soon
                    self._cv.wait_for(lambda a=after: a in self._done, timeout=5.0)
                start = max(t_disp, self._lane_end.get(lane, 0.0), self._done.get(after, 0.0))
                self._busy[phase] += max(0.0, t - start)
                self._lane_end[lane] = t
                if key is not None:
                    self._done[key] = t
                    self._cv.notify_all()
            q.task_done()
