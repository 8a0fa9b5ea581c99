"""What the schedulers learn online about each task type: environment waits, compute per turn,
and where live tasks are (executing, ready for the engine, waiting on their environment). No JAX.

A task alternates between its turn on a rank (executing: prefill + decode) and its environment
(waiting: `/start` or `/observation` in flight); once the environment answers it is ready and
wants the engine again. A waiting task holds KV but no compute (arXiv 2608.10402, §4), so how
long it will still wait decides whether its KV is worth keeping: `WaitModel.remaining` is the
expected remaining wait of a task that has waited `a` seconds, E[W - a | W > a], from the waits
seen so far (heavy tails make it grow with `a`: the task that has waited longest will most
likely wait longest).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

PHASES = ("executing", "ready", "waiting")


class WaitModel:
    """Recent samples of one task type's environment waits (seconds), kept sorted."""

    def __init__(self, window: int = 256):
        self.window = window
        self._order: collections.deque[float] = collections.deque()
        self._sorted: list[float] = []
        self._suffix: list[float] | None = None
        self._mean: float | None = None
        self.count = 0
        self.total = 0.0

    def add(self, wait_s: float) -> None:
        wait_s = max(0.0, float(wait_s))
        self._order.append(wait_s)
        bisect.insort(self._sorted, wait_s)
        if len(self._order) > self.window:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._suffix = None
        self._mean = None
        self.count += 1
        self.total += wait_s

    def __len__(self) -> int:
        return len(self._sorted)

    @property
    def mean(self) -> float | None:
        # Read far more often than samples arrive (every scheduling round, per waiting
        # task): summed once per sample.
        if self._mean is None and self._sorted:
            self._mean = sum(self._sorted) / len(self._sorted)
        return self._mean

    def remaining(self, waited_s: float) -> float | None:
        """E[W - a | W > a] over the samples; past the largest sample, the largest sample's
        excess over the mean (a wait longer than any seen is taken to go on about as long
        again as the longest did beyond the mean). None before any sample."""
        xs = self._sorted
        if not xs:
            return None
        if self._suffix is None:
            acc, suf = 0.0, [0.0] * (len(xs) + 1)
            for i in range(len(xs) - 1, -1, -1):
                acc += xs[i]
                suf[i] = acc
            self._suffix = suf
        i = bisect.bisect_right(xs, waited_s)
        n = len(xs) - i
        if n == 0:
            mean = self._suffix[0] / len(xs)
            return max(xs[-1] - mean, mean)
        return self._suffix[i] / n - waited_s


@dataclasses.dataclass
class TypeStats:
    """One task type: its environment waits and its compute per turn."""

    waits: WaitModel = dataclasses.field(default_factory=WaitModel)
    compute_s: float = 0.0
    """Mean seconds a turn spends outside its environment: from the answer to the turn's
    end, waiting for room and for the engine included (exponential average)."""
    turns: int = 0
    turn_s: float = 0.0
    """Mean seconds a turn executes on its rank: from its start (room found, the engine's
    prefill requested) to its end (exponential average)."""

    def add_compute(self, seconds: float, turn_s: float, alpha: float = 0.1) -> None:
        """A turn ended: `seconds` since its environment answered, `turn_s` of them on its
        rank."""
        self.turns += 1
        a = 1.0 if self.turns == 1 else alpha
        self.compute_s += a * (max(0.0, seconds) - self.compute_s)
        self.turn_s += a * (max(0.0, turn_s) - self.turn_s)

    @property
    def wait_fraction(self) -> float | None:
        """Share of a turn cycle spent waiting on the environment (None before data)."""
        w = self.waits.mean
        if w is None or not self.turns:
            return None
        return w / max(w + self.compute_s, 1e-9)


class PhaseOccupancy:
    """Time integrals of how many live tasks are in each phase, and of how many tasks wait for
    admission (`queued`: the scheduler's count of them), for per-step averages."""

    def __init__(self, now: float = 0.0):
        self.counts = dict.fromkeys(PHASES, 0)
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.queued = 0
        """Tasks submitted and not admitted yet (not live: in no phase)."""
        self.queued_seconds = 0.0
        self._last = now

    def advance(self, now: float) -> None:
        dt = now - self._last
        if dt > 0:
            for k, n in self.counts.items():
                self.seconds[k] += n * dt
            self.queued_seconds += self.queued * dt
        self._last = max(self._last, now)

    def integrals(self) -> dict[str, float]:
        """Task-seconds integrated so far per phase, and `queued` (to difference over a
        window: its mean counts)."""
        return {**self.seconds, "queued": self.queued_seconds}

    def current(self) -> dict[str, float]:
        """The counts now per phase, and `queued` (keys as `integrals`)."""
        return {**{k: float(n) for k, n in self.counts.items()}, "queued": float(self.queued)}

    def queue(self, now: float, delta: int) -> None:
        """`delta` tasks joined (> 0) or left (< 0) the admission queue at `now`."""
        self.advance(now)
        self.queued += delta

    def rebase(self, now: float) -> None:
        """A new clock: integrate from `now` on (what was integrated stays)."""
        self._last = now

    def move(self, now: float, old: str | None, new: str | None) -> None:
        self.advance(now)
        if old is not None:
            self.counts[old] -= 1
        if new is not None:
            self.counts[new] += 1
