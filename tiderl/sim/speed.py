"""The machine's speed, probed: one fixed device call timed when the `cpu-fitted` profile is
fitted and again around every real run `python -m tiderl.sim.validate` compares against.

On a shared VM the same computation does not take the same time from one minute to the next
(`benchmarks/host_drift.py`: medians of 20 calls of the probe below ranged 10.3 to 20.9 ms over
six idle minutes on a 2-core AMD EPYC VM). The profile prices every operation at the speed
the machine had while it was fitted; real runs made at another time run at another speed.
The probe, a Ref forward of the validation job's trainer over one fixed micro-batch (21
sequences of 35-55 tokens packed in 16 rows of 128, the validation job's usual shape),
measures both moments alike; the validator scales the profile's timed costs by the ratio
of the real runs' probe to the calibration's (`Profile.scaled`).

JAX is imported inside the functions only (the package stays JAX-free).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

PROBE_CALLS = 20
"""Calls a probe times; the probe is their median."""


def _fixed_microbatch(cfg: Any) -> Any:
    import numpy as np

    from tiderl.train.dispatch import TrainSequence, microbatches

    t = cfg.trainer
    rng = np.random.default_rng(0)
    seqs = []
    for i, n in enumerate(rng.integers(35, 56, 21)):
        mask = np.zeros(n, bool)
        mask[n // 2:] = True
        seqs.append(TrainSequence(i, rng.integers(1, cfg.model.vocab_size, n).astype(np.int32),
                                  mask, np.full(n, -4.0, np.float32), 0.5,
                                  np.zeros(n, np.int32)))
    mbs, _ = microbatches(seqs, n_ranks=1, row_len=t.row_len, rows_per_rank=2 * t.rows_per_rank)
    return mbs[0]


class SpeedProbe:
    """The probe's trainer (the job `cfg`'s model and trainer: the calibration's, made with
    `tiderl.sim.calibrate.VALIDATION_OVERRIDES`) and micro-batch, built and compiled once;
    calling it times `PROBE_CALLS` Ref forwards and returns their median in seconds."""

    def __init__(self, cfg: Any) -> None:
        import jax

        from tiderl.runtime.build import build
        from tiderl.train.backend import TrainerBackend

        _, _, meshes, graphdef, params = build(cfg)
        self._be = TrainerBackend(cfg.trainer, cfg.model, actor_mesh=meshes["actor"],
                                  policy=(graphdef, params), temperature=cfg.rollout.temperature)
        self.mb = _fixed_microbatch(cfg)
        self._batch = self._be.put(self.mb, "actor")
        self._block = jax.block_until_ready
        self._block(self._be.ref_forward(self._batch))  # compiles, untimed

    def __call__(self, calls: int = PROBE_CALLS) -> float:
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            self._block(self._be.ref_forward(self._batch))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def close(self) -> None:
        self._be.close()


def speed_factor(profile_notes: dict[str, Any], run_probes_s: Sequence[float]
                 ) -> float | None:
    """How much slower than at its fit the machine ran the real runs: the median of the runs'
    probes over the calibration's (`notes.speed_probe.seconds`); None when either side was
    not probed (profiles and runs recorded before the probe)."""
    fitted = (profile_notes.get("speed_probe") or {}).get("seconds")
    probes = [p for p in run_probes_s if p and p > 0]
    if not fitted or not probes:
        return None
    return statistics.median(probes) / fitted
