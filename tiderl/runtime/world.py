"""One JAX world across hosts: `jax.distributed` start-up, process roles, the control channel,
barriers with timeouts, and a clear stop when a process dies.

One process per host. Process 0 (the leader) runs the asyncio controller and is also a host;
every process owns the rollout ranks on its own devices and takes part in the trainer's SPMD
steps (`tiderl.runtime.hosts`). Where the world comes from (`distributed.coordinator`):

- `''` (default): one process, no `jax.distributed` at all.
- `'HOST:PORT'` with `distributed.num_processes` and `distributed.process_id` (the launch flags
  `--coordinator`, `--num-processes`, `--process-id`).
- `'auto'`: `MASTER_ADDR`/`MASTER_PORT`/`WORLD_SIZE`/`RANK` (torchrun-style launchers),
  `JAX_COORDINATOR_ADDRESS`/`JAX_NUM_PROCESSES`/`JAX_PROCESS_ID`, or JAX's own detection
  (SLURM, Open MPI, Kubernetes, TPU pods).

The control channel is the coordination service's key-value store (`Channel`), not a socket
of our own: every process is already connected to it, it is ordered per stream and usable from
plain threads (the SPMD plan is consumed on one control thread per process), it needs no extra
port, address exchange or bearer token, and a dead peer shows up in one place (the service's
heartbeats). Bulk data never travels through it: weights move device to device.

A process that dies: the coordination service notices its missing heartbeats after
`distributed.heartbeat_timeout_s`; the watchdog of every other process then prints one line
naming it and exits with code 4 (the checkpoints already written stay intact; restart every
process with `--resume`). The service runs in recoverable mode so that this line, not JAX's
abort of every process, is what users see. When process 0 itself dies the coordination service
goes with it and JAX's client aborts the other processes at once; `tiderl.runtime.supervise` (the thin
parent launch puts around each process) turns that into the same kind of line, naming
process 0.

JAX is imported lazily: the config and `resolve` are JAX-free (config.py imports this module).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from tiderl.configlib import LOOPBACK, ConfigError

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 4
"""Exit code of a process stopped because another process of its world died."""



@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How the processes of one job find each other (one process per host)."""

    coordinator: str = ""
    """'' for one process; 'HOST:PORT' of process 0 (every process passes the same); 'auto' to
    detect it from the launcher (torchrun-style variables, JAX_* variables, SLURM, Open MPI)."""
    num_processes: int = 0
    """Processes in the world (0: from the launcher with coordinator=auto)."""
    process_id: int = -1
    """This process's index, 0..num_processes-1 (-1: from the launcher with coordinator=auto)."""
    coordinator_bind: str = ""
    """Address process 0's coordination service binds; '' binds loopback for a loopback
    coordinator and all interfaces (JAX's default) otherwise. The service has no
    authentication: on a cluster, keep its port inside the job's private network."""
    heartbeat_timeout_s: int = 30
    """A process silent this long is dead and the others stop. Heartbeats come from a C++ thread,
    so Python stalls and XLA compiles do not delay them; only a dead process, a frozen host or a
    network partition does. Lower means a dead host idles everyone's devices for less time;
    30 s rides out a switch hiccup. (JAX's own default is 100 s.)"""
    init_timeout_s: int = 300
    """How long a process waits at start-up for all the others to join."""
    barrier_timeout_s: float = 600.0
    """How long a process waits for the others at a barrier (run-folder set-up, end of run)."""
    transfer_address: str = ""
    """'HOST[:PORT]' this process serves cross-process device_put on (the CPU backend's socket
    transfers, `jax_cross_host_transfer_socket_address`); '' uses the address this host reaches
    the coordinator from and a free port."""
    weight_source: Literal["local", "process0"] = "local"
    """Where a rollout rank's new weights come from: 'local' copies them from the trainer
    replica on the rank's own process (no cross-process traffic) when that process holds one,
    else from process 0's; 'process0' always sends them from process 0's replica
    (cross-process device_put; what a process without a trainer cell needs)."""

    def __post_init__(self):
        if self.coordinator not in ("", "auto"):
            _split_address(self.coordinator, "distributed.coordinator")
        for name in ("heartbeat_timeout_s", "init_timeout_s", "barrier_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config key 'distributed.{name}' must be positive, got "
                                  f"{getattr(self, name)}")
        if self.num_processes < 0:
            raise ConfigError("config key 'distributed.num_processes' must be >= 0")
        if self.num_processes and self.process_id >= self.num_processes:
            raise ConfigError(
                f"config key 'distributed.process_id'={self.process_id} is not below "
                f"distributed.num_processes={self.num_processes}; ids run 0..num_processes-1")


def _split_address(addr: str, key: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"config key '{key}'={addr!r} is not HOST:PORT (e.g. "
                          "10.0.0.1:8476 or 127.0.0.1:8476)")
    return host, int(port)


@dataclasses.dataclass(frozen=True)
class WorldSpec:
    coordinator: str
    num_processes: int
    process_id: int
    source: str
    """Where the three came from (config, or the launcher's variables)."""


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    v = env.get(key, "")
    return int(v) if v.strip().lstrip("-").isdigit() else None


def resolve(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> WorldSpec | None:
    """The world this process belongs to, or None for one process (JAX-free).

    With coordinator='auto' and no torchrun-style or JAX_* variables, returns a spec with an
    empty coordinator: JAX's own cluster detection (SLURM, Open MPI, ...) fills it in."""
    env = os.environ if env is None else env
    if cfg.coordinator == "":
        if cfg.num_processes > 1:
            raise ConfigError(
                f"config key 'distributed.num_processes'={cfg.num_processes} needs "
                "distributed.coordinator (HOST:PORT of process 0, or auto); pass --coordinator")
        tasks = _env_int(env, "SLURM_NTASKS") or 0
        if tasks > 1 and "SLURM_JOB_ID" in env:
            raise ConfigError(
                f"this process is one of SLURM_NTASKS={tasks} tasks but "
                "distributed.coordinator is unset, so each would run its own job in the same "
                "run_dir; pass --coordinator auto (or run one task)")
        return None
    if cfg.coordinator == "auto":
        spec = _from_launcher(env)
        if spec is None:
            spec = WorldSpec("", cfg.num_processes, cfg.process_id, "jax cluster detection")
    else:
        if cfg.num_processes <= 0 or cfg.process_id < 0:
            raise ConfigError(
                f"config key 'distributed.coordinator'={cfg.coordinator!r} needs "
                "distributed.num_processes and distributed.process_id too (--num-processes N "
                "--process-id I on every process), or coordinator=auto under a launcher")
        spec = WorldSpec(cfg.coordinator, cfg.num_processes, cfg.process_id, "config")
    n = cfg.num_processes or spec.num_processes
    pid = cfg.process_id if cfg.process_id >= 0 else spec.process_id
    spec = dataclasses.replace(spec, num_processes=n, process_id=pid)
    if spec.coordinator and n == 1:
        return None
    return spec


def _from_launcher(env: Mapping[str, str]) -> WorldSpec | None:
    for addr_k, port_k, n_k, id_k in (("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"),):
        if all(k in env for k in (addr_k, port_k, n_k, id_k)):
            return WorldSpec(f"{env[addr_k]}:{env[port_k]}", int(env[n_k]), int(env[id_k]),
                             f"{addr_k}/{port_k}/{n_k}/{id_k}")
    if all(k in env for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                              "JAX_PROCESS_ID")):
        return WorldSpec(env["JAX_COORDINATOR_ADDRESS"], int(env["JAX_NUM_PROCESSES"]),
                         int(env["JAX_PROCESS_ID"]), "JAX_COORDINATOR_ADDRESS/...")
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _local_address_towards(host: str) -> str:
    """The address of this host's interface that routes to `host` (no packet is sent)."""
    if host in LOOPBACK:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def transfer_address(cfg: DistributedConfig, coordinator: str) -> str:
    """`jax_cross_host_transfer_socket_address` for this process: HOST:PORT peers can reach."""
    if cfg.transfer_address:
        host, sep, port = cfg.transfer_address.rpartition(":")
        if sep and port.isdigit():
            return cfg.transfer_address
        host = cfg.transfer_address
    else:
        host = _local_address_towards(coordinator.rpartition(":")[0])
    # Port 0 is not resolved by the transfer library (peers would dial port 0): pick one.
    return f"{host}:{free_port(host if host not in ('0.0.0.0', '::') else '')}"


class WorldError(RuntimeError):
    """The world could not be formed, or a peer is gone (the message names which and why)."""


class StoppedByLeader(WorldError):
    """Process 0 ended the run with an error; the other processes stop with its reason."""


def _short(e: BaseException, n: int = 200) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= n else s[: n - 3] + "..."


class World:
    """This process's place in the job: id, size, the coordination client, the watchdog."""

    def __init__(self, process_id: int = 0, size: int = 1, *, client: Any = None,
                 cfg: DistributedConfig | None = None, spec: WorldSpec | None = None):
        self.process_id, self.size, self.client = process_id, size, client
        self.cfg = cfg or DistributedConfig()
        self.spec = spec
        self.hint = ""
        """Appended to the stop line (launch sets it: where the checkpoints are)."""
        self._closing = threading.Event()
        self._on_lost: list[Callable[[str], None]] = []
        self._channel: Any = None
        self._stopping = threading.Lock()

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def role(self) -> str:
        return "controller + host agent" if self.is_leader else "host agent"

    def describe(self) -> str:
        if self.size == 1:
            return "one process"
        return (f"process {self.process_id} of {self.size} ({self.role}); coordinator "
                f"{self.spec.coordinator if self.spec else '?'}")

    # -- control channel and barriers ----------------------------------------------------------
    def channel(self):
        if self._channel is None:
            from tiderl.runtime.channel import Channel

            self._channel = Channel(self)
        return self._channel

    def barrier(self, name: str, timeout_s: float | None = None) -> None:
        """Every process waits here until all arrive; a missing one is a WorldError naming the
        barrier and the timeout (the watchdog names a dead process sooner)."""
        if self.size == 1:
            return
        t = self.cfg.barrier_timeout_s if timeout_s is None else timeout_s
        try:
            self.client.wait_at_barrier(f"tiderl/{name}", int(t * 1000))
        except Exception as e:  # noqa: BLE001 - JAX raises its runtime error type
            raise WorldError(f"process {self.process_id}: not every process reached barrier "
                             f"{name!r} within {t:g} s ({_short(e)})") from e

    # -- liveness ------------------------------------------------------------------------------
    def on_lost(self, fn: Callable[[str], None]) -> None:
        """`fn(message)` runs (best effort) before a process stopped by a dead peer exits."""
        self._on_lost.append(fn)

    def start_watchdog(self, poll_s: float = 0.5) -> None:
        if self.size > 1:
            threading.Thread(target=self._watch, args=(poll_s,), name="tiderl-watchdog",
                             daemon=True).start()

    def _watch(self, poll_s: float) -> None:
        ids = list(range(self.size))
        while not self._closing.wait(poll_s):
            try:
                live = self.client.get_live_nodes(ids)
            except Exception as e:  # noqa: BLE001 - the coordinator is gone
                if self._closing.is_set():
                    return
                self.stop(f"process {self.process_id} lost the coordinator (process 0 at "
                          f"{self.spec.coordinator if self.spec else '?'}): {_short(e, 120)}")
                return
            dead = [i for i in ids if i not in live]
            if dead and not self._closing.is_set():
                who = ", ".join(str(i) for i in dead)
                self.stop(f"process {who} of {self.size} died (no heartbeat for "
                          f"distributed.heartbeat_timeout_s={self.cfg.heartbeat_timeout_s} s)")
                return

    def stop(self, reason: str, code: int = EXIT_PEER_LOST) -> None:
        """Prints one line and ends this process now. Used when a peer is gone: this process
        may be blocked inside a collective that can never complete, so nothing is joined."""
        with self._stopping:
            for fn in self._on_lost:
                try:
                    fn(reason)
                except Exception:  # noqa: BLE001, S110 - best effort on the way out
                    pass
            line = f"tiderl: stopped: {reason}"
            if self.hint:
                line += f"; {self.hint}"
            print(line, file=sys.stderr, flush=True)
            os._exit(code)

    # -- the end -------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Leaves the world in order: everyone meets at a last barrier, the other processes
        disconnect, then process 0 (whose service they talk to) goes last."""
        if self.size == 1 or self.client is None:
            return
        import jax

        self._closing.set()
        if self._channel is not None:
            self._channel.close()
        try:
            self.client.wait_at_barrier("tiderl/exit", int(timeout_s * 1000))
        except Exception as e:  # noqa: BLE001 - a peer is gone; leave anyway
            log.warning("leaving without every process at the exit barrier: %s", _short(e))
        if self.is_leader:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    if len(self.client.get_live_nodes(list(range(self.size)))) <= 1:
                        break
                except Exception:  # noqa: BLE001
                    break
                time.sleep(0.1)
        jax.distributed.shutdown()
        self.client = None


_WORLD: World | None = None


def current() -> World:
    """This process's world (one process until `initialize` formed a bigger one)."""
    return _WORLD if _WORLD is not None else World()


def initialize(cfg: DistributedConfig) -> World:
    """Joins the world `cfg` describes (before any JAX backend starts); idempotent."""
    global _WORLD
    if _WORLD is not None and _WORLD.size > 1:
        return _WORLD
    spec = resolve(cfg)
    if spec is None:
        _WORLD = World(cfg=cfg)
        return _WORLD
    import jax

    if not spec.coordinator or spec.num_processes <= 0 or spec.process_id < 0:
        spec = _detect_with_jax(cfg, spec)
    host, port = _split_address(spec.coordinator, "distributed.coordinator")
    bind = cfg.coordinator_bind or (f"{host}:{port}" if host in LOOPBACK else None)
    # Recoverable: a dead process is reported to the others (our watchdog's line) instead of
    # the service aborting every process with a stack trace.
    jax.config.update("jax_enable_recoverability", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # No persistent compilation cache across processes: an executable with CPU (gloo)
    # collectives loaded from the cache fails after a resume; each process compiles afresh.
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_cross_host_transfer_socket_address",
                      transfer_address(cfg, spec.coordinator))
    try:
        jax.distributed.initialize(
            spec.coordinator, num_processes=spec.num_processes, process_id=spec.process_id,
            cluster_detection_method="deactivate", initialization_timeout=cfg.init_timeout_s,
            heartbeat_timeout_seconds=cfg.heartbeat_timeout_s, coordinator_bind_address=bind)
    except Exception as e:  # noqa: BLE001 - JAX raises its runtime error type
        raise WorldError(
            f"process {spec.process_id} of {spec.num_processes} could not join the world at "
            f"distributed.coordinator={spec.coordinator} within distributed.init_timeout_s="
            f"{cfg.init_timeout_s} ({_short(e)}); start every process with the same "
            "--coordinator and --num-processes and a distinct --process-id") from e
    from jax._src import distributed as jax_distributed  # the client: KV store, barriers

    _WORLD = World(spec.process_id, spec.num_processes,
                   client=jax_distributed.global_state.client, cfg=cfg, spec=spec)
    _WORLD.start_watchdog()
    log.info("joined the world: %s (from %s)", _WORLD.describe(), spec.source)
    return _WORLD


def _detect_with_jax(cfg: DistributedConfig, spec: WorldSpec) -> WorldSpec:
    """JAX's cluster detection (SLURM, Open MPI, Kubernetes, TPU) for what is still unset.
    Device visibility stays ours: one process per host sees all of that host's devices."""
    from jax._src import clusters

    addr, n, pid, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        spec.coordinator or None, spec.num_processes or None,
        spec.process_id if spec.process_id >= 0 else None, None, None, cfg.init_timeout_s)
    if addr is None or n is None or pid is None:
        raise ConfigError(
            "config key 'distributed.coordinator'=auto found no launcher to take the world "
            "from (torchrun-style MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK, JAX_COORDINATOR_"
            "ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID, SLURM, Open MPI); pass --coordinator "
            "HOST:PORT --num-processes N --process-id I")
    return WorldSpec(addr, int(n), int(pid), "jax cluster detection")
