"""Device profiles: the per-operation costs (`OpCost`) of one device and engine, read from
`tiderl/sim/profiles/*.yaml`, with the device and engine facts they rest on. No JAX.

Every operation costs `c0 + max_k(work_k / rate_k)` (`tiderl.sim.costs` computes the work); a
profile gives the rates and `c0`:

- `kind: roofline` (`h100`): rates derived from the device's peak numbers and the achievable
  fractions stated in the profile (MFU of training and prefill, HBM efficiency of decode, link
  bandwidths), overheads stated per operation.
- `kind: fitted` (`cpu-fitted`): `c0` and rates per operation fitted by
  `python -m tiderl.sim.calibrate` to micro-benchmarks of the real engine and trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiderl.configlib import ConfigError

PROFILES = Path(__file__).with_name("profiles")
COMPONENTS = ("flops", "hbm", "link", "pcie")
OPS = ("prefill", "decode", "ref_forward", "actor_forward", "actor_backward", "apply", "swap",
       "weight_sync", "role_change", "context_switch", "env_call", "env_client", "env_server",
       "sample")


@dataclasses.dataclass(frozen=True)
class OpCost:
    """`c0 + max_k(work_k / rate_k)`; a rate of 0 means the component is not charged."""

    c0: float = 0.0
    rates: tuple[tuple[str, float], ...] = ()

    def __call__(self, **work: float) -> float:
        t = 0.0
        for k, rate in self.rates:
            w = work.get(k, 0.0)
            if rate > 0 and w > 0:
                t = max(t, w / rate)
        return self.c0 + t

    def rate(self, k: str) -> float:
        return dict(self.rates).get(k, 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator and its links (a roofline profile's `device:` section)."""

    flops: float
    hbm_bw: float
    hbm_bytes: float
    nvlink_bw: float = 0.0
    cross_node_bw: float = 0.0
    pcie_bw: float = 0.0
    gpus_per_node: int = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineRules:
    """How the engine batches work (what its cost is computed over)."""

    padded: bool = False
    """Work counts padded shapes: rows up to a decode bucket, lengths up to a prefill bucket,
    attention over each row's whole page table (our JAX engine's reference path). False: exact
    token counts and causal attention (a varlen flash-attention engine, vLLM)."""
    prefill_buckets: tuple[int, ...] = (8192,)
    decode_buckets: tuple[int, ...] = (1024,)
    max_context: int = 8192
    decode_steps_per_call: int = 1
    """Decode steps one `generate` call runs before the host looks again (vLLM's multi-step
    scheduling); 1 is the JAX engine's behaviour."""
    kv_fraction: float = 0.9
    """Share of HBM the engine may use (vLLM's gpu_memory_utilization); the KV pool is that
    minus the weights and `activation_bytes`."""
    activation_bytes: float = 0.0


@dataclasses.dataclass(frozen=True)
class Profile:
    """A device profile: per-operation costs plus the device and engine facts they rest on."""

    name: str
    kind: str
    ops: Mapping[str, OpCost]
    device: Device | None
    engine: EngineRules
    notes: Mapping[str, Any]
    host: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """The parts share one host (`tiderl.sim.host`): its effective `capacity` in cores."""
    memory: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Per-device memory facts (`tiderl.sim.memory`): `runtime_bytes`."""

    def scaled(self, factor: float) -> Profile:
        """The same profile on a machine `factor` times slower: every operation's time (its
        constant and its rates) and the interpreter lock's wait scale by `factor`; the host's
        effective cores (a ratio) do not."""
        if factor <= 0:
            raise ValueError(f"speed factor {factor} must be positive")
        ops = {k: OpCost(v.c0 * factor, tuple((n, r / factor) for n, r in v.rates))
               for k, v in self.ops.items()}
        host = dict(self.host)
        if "lock_wait_s" in host:
            host["lock_wait_s"] *= factor
        return dataclasses.replace(self, ops=ops, host=host)

    def op(self, name: str) -> OpCost:
        if name not in self.ops:
            raise ConfigError(f"profile {self.name!r} has no cost for operation {name!r}; add "
                              f"ops.{name} to its YAML (operations: {', '.join(OPS)})")
        return self.ops[name]


def load_profile(name_or_path: str | Path) -> Profile:
    """A profile by name (`h100`, `cpu-fitted`) or YAML path."""
    import yaml

    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PROFILES.glob("*.yaml"))
        hint = " (run python -m tiderl.sim.calibrate to fit it)" if "fitted" in str(path) else ""
        raise ConfigError(f"sim profile {str(name_or_path)!r} not found at {path}{hint}; known "
                          f"profiles: {', '.join(known)}")
    return profile_from_dict(yaml.safe_load(path.read_text()), source=str(path))


def _num(v: Any) -> Any:
    """YAML 1.1 reads `4.0e9` (no sign in the exponent) as a string; numbers are meant."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    if isinstance(v, list):
        return tuple(_num(x) for x in v)
    return v


def profile_from_dict(d: Mapping[str, Any], *, source: str = "<dict>") -> Profile:
    kind = d.get("kind")
    fields = {f.name: f.type for f in dataclasses.fields(EngineRules)}
    eng_spec = {}
    for k, v in (d.get("engine") or {}).items():
        if k not in fields:
            raise ConfigError(f"sim profile {source}: engine.{k} is unknown; known keys: "
                              f"{', '.join(fields)}")
        v = _num(v)
        eng_spec[k] = int(v) if fields[k] == "int" else v
    eng = EngineRules(**eng_spec)
    d = {**d, "efficiency": {k: _num(v) for k, v in (d.get("efficiency") or {}).items()},
         "overheads": {k: _num(v) for k, v in (d.get("overheads") or {}).items()}}
    if kind == "roofline":
        dev = Device(**{k: float(_num(v)) if k != "gpus_per_node" else int(v)
                        for k, v in d["device"].items()})
        ops = _roofline_ops(dev, d.get("efficiency", {}), d.get("overheads", {}), source)
    elif kind == "fitted":
        dev = Device(**{k: float(_num(v)) if k != "gpus_per_node" else int(v)
                        for k, v in d["device"].items()}) if d.get("device") else None
        ops = {}
        for name, spec in (d.get("ops") or {}).items():
            rates = tuple((k, float(_num(spec[k]))) for k in COMPONENTS if spec.get(k))
            ops[name] = OpCost(float(_num(spec.get("c0", 0.0))), rates)
    else:
        raise ConfigError(f"sim profile {source}: kind={kind!r}; use 'roofline' or 'fitted'")
    host = {k: float(_num(v)) for k, v in (d.get("host") or {}).items()}
    unknown = set(host) - {"capacity", "lock_wait_s"}
    if unknown:
        raise ConfigError(f"sim profile {source}: host.{sorted(unknown)[0]} is unknown; use "
                          "host.capacity (effective cores the parts share) and "
                          "host.lock_wait_s (an engine call's wait for the interpreter lock beside a busy "
                          "event loop)")
    memory = {k: float(_num(v)) for k, v in (d.get("memory") or {}).items()}
    if set(memory) - {"runtime_bytes"}:
        raise ConfigError(f"sim profile {source}: memory.{sorted(set(memory))[0]} is unknown; "
                          "use memory.runtime_bytes (per-device bytes besides the models)")
    return Profile(str(d.get("name", Path(source).stem)), kind, ops, dev, eng,
                   dict(d.get("notes") or {}), host, memory)


def _roofline_ops(dev: Device, eff: Mapping[str, float], over: Mapping[str, float],
                  source: str) -> dict[str, OpCost]:
    need = ("train", "prefill", "decode_flops", "hbm")
    missing = [k for k in need if k not in eff]
    if missing:
        raise ConfigError(f"sim profile {source}: efficiency.{missing[0]} is missing (needs "
                          f"{', '.join(need)})")
    hbm = dev.hbm_bw * eff["hbm"]

    def op(c0_key: str, **rates: float) -> OpCost:
        return OpCost(float(over.get(c0_key, 0.0)), tuple(rates.items()))

    train = dev.flops * eff["train"]
    # "link": the network a collective runs over; the caller picks intra- or cross-node
    # bandwidth by scaling work (see `SimCostModel.link_bytes`), so the rate here is NVLink's.
    return {
        "prefill": op("prefill_c0", flops=dev.flops * eff["prefill"], hbm=hbm),
        "decode": op("decode_c0", flops=dev.flops * eff["decode_flops"], hbm=hbm),
        "ref_forward": op("train_mb_c0", flops=train, hbm=hbm, link=dev.nvlink_bw),
        "actor_forward": op("train_mb_c0", flops=train, hbm=hbm, link=dev.nvlink_bw),
        "actor_backward": op("train_mb_c0", flops=train, hbm=hbm, link=dev.nvlink_bw),
        "apply": op("apply_c0", hbm=hbm, link=dev.nvlink_bw),
        "swap": op("swap_c0", pcie=dev.pcie_bw),
        "weight_sync": op("sync_c0", link=dev.nvlink_bw),
        "role_change": op("role_change_c0", pcie=dev.pcie_bw),
        "context_switch": op("context_switch_c0"),
        "env_call": op("env_call_c0"),
        # Siblings sampled from a sibling's logits (prefix sharing): on these devices that
        # rides in the step's sampling kernel, as vLLM samples every row of a step at once,
        # so it costs its overhead only (`sample_c0`, 0 in the shipped profiles).
        "sample": op("sample_c0"),
    }
