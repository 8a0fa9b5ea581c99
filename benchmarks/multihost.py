"""Several hosts on one machine: N processes joined over loopback (fake CPU devices, gloo).

Two parts, both with N processes of 4 fake devices each:

1. Weight sync, shard to shard. Every process builds the same trainer (data = N cells of
   fsdp=2) and one rollout rank (tensor-parallel over 2 devices) per process, then syncs a
   policy of `--sync-params` parameters: in-process (each rank from its own process's trainer
   replica: device-to-device reshard), cross-process (every rank from process 0's replica:
   `jax.device_put` between cells of matching shard shapes) and, for reference, in-process
   through host memory (`device_get` + `device_put`, what staging costs). One untimed warm-up of
   each, then `--repeats` rounds in rotated order; GB/s medians (bytes of the weights / time on
   the receiving process).
2. The job: the same small job (on-policy async, 2 groups/step) in N processes and in one
   process with N × 4 devices, one after the other: the parameters after `--steps` steps
   compared (max relative difference), and the step time split (median over the steps after
   the first) of both, with the sync figures the job itself logged to metrics.jsonl.

    python benchmarks/multihost.py [--processes 2] [--steps 6] [--repeats 5] [--quick]

On this CPU "devices" are slices of the same two cores and "cross-process" is a loopback
socket: read the GB/s as what the mechanism costs here, not as NVLink or InfiniBand figures.
The last line is one JSON object (`processes`, `max_param_diff_vs_single`, `sync_gbps`, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LOCAL_DEVICES = 4
JOB = [
    "cluster.platform=cpu", "controller.mode=async", "controller.max_staleness=0",
    "controller.groups_per_step=2", "controller.groups_per_microbatch=1",
    "controller.eval_every=0", "controller.console=false", "env.group_size=4",
    "trainer.zero_var_groups=keep", "rollout.devices_per_rank=2", "trainer.fsdp=2",
    "rollout.decode_buckets=[8]", "rollout.max_slots=8", "rollout.prefill_buckets=[64]",
    "rollout.prefill_batch=8", "rollout.num_pages=96", "trainer.rows_per_rank=1",
    "distributed.weight_source=process0", "distributed.heartbeat_timeout_s=30",
]


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


# ------------------------------------------------------------------------------ 1. weight sync
def sync_worker(args: argparse.Namespace) -> None:
    """One process of the sync benchmark (spawned N times by `bench_sync`)."""
    import jax

    from tiderl.models.config import ModelConfig
    from tiderl.models.policy import init_policy
    from tiderl.runtime.cells import host_plan, role_map
    from tiderl.runtime.devices import ClusterConfig, init_jax, role_meshes
    from tiderl.runtime.weightsync import SyncPlan, SyncStats, local_replica, tree_bytes
    from tiderl.runtime.world import DistributedConfig, initialize

    n, me = args.processes, args.process_id
    world = initialize(DistributedConfig(coordinator=args.coordinator, num_processes=n,
                                         process_id=me, heartbeat_timeout_s=60))
    devices = init_jax(ClusterConfig(platform="cpu", fake_cpu_devices=LOCAL_DEVICES))
    plan = host_plan(n_processes=n, local_devices=LOCAL_DEVICES, ranks=n, devices_per_rank=2,
                     actor_devices=2 * n, ref_devices=0, fsdp=2, model_parallel=1)
    meshes = role_meshes(plan, devices, fsdp=2)
    d = args.sync_d_model
    model = ModelConfig(d_model=d, n_layers=args.sync_layers, n_heads=8, n_kv_heads=4,
                        head_dim=d // 8, mlp_dim=4 * d, vocab_size=4096)
    _, params = init_policy(model, seed=0, mesh=meshes["actor"])
    abstract = jax.eval_shape(lambda: params)
    cells = role_map(plan, local_devices=LOCAL_DEVICES, fsdp=2, model_parallel=1).rollout()
    mk = lambda src: SyncPlan(process=me, size=n, rank_meshes=list(meshes["rollout"]),  # noqa: E731
                              rank_process=[c.process for c in cells],
                              trainer_mesh=meshes["actor"], abstract=abstract,
                              weight_source=src, barrier=world.barrier)
    plans = {"in_process": mk("local"), "cross_process": mk("process0")}
    mine = next(r for r, c in enumerate(cells) if c.process == me)

    def host_staged() -> SyncStats:
        replica = local_replica(params, me)
        t0 = time.perf_counter()
        out = jax.device_put(jax.device_get(replica), plans["in_process"].targets[mine])
        jax.block_until_ready(out)
        return SyncStats(local_bytes=tree_bytes(abstract), local_s=time.perf_counter() - t0)

    def run(kind: str) -> SyncStats:
        if kind == "host_staged":
            return host_staged()
        _, stats = plans[kind].run(params)
        return stats[mine]

    kinds = ["in_process", "cross_process", "host_staged"]
    for k in kinds:  # warm-up: compiles the reshards, opens the transfer sockets
        run(k)
        world.barrier(f"warm/{k}")
    rows: list[dict] = []
    for rep in range(args.repeats):
        for k in kinds[rep % 3:] + kinds[:rep % 3]:  # rotated order
            s = run(k)
            world.barrier(f"rep/{rep}/{k}")
            b, t = (s.cross_bytes, s.cross_s) if s.cross_bytes else (s.local_bytes, s.local_s)
            rows.append({"kind": k, "process": me, "bytes": b, "s": t})
    ch = world.channel()
    if me == 0:
        for k in range(1, n):
            rows += ch.recv(k, "bench")["rows"]
        print("SYNC " + json.dumps({"rows": rows, "bytes": tree_bytes(abstract)}), flush=True)
    else:
        ch.send(0, "bench", {"rows": rows})
    world.shutdown()


def bench_sync(args: argparse.Namespace, tmp: Path) -> dict:
    from tiderl.runtime.world import free_port

    port = free_port()
    cmd = lambda i: [sys.executable, __file__, "--sync-worker", "--process-id", str(i),  # noqa: E731
                     "--coordinator", f"127.0.0.1:{port}", "--processes", str(args.processes),
                     "--repeats", str(args.repeats), "--sync-d-model", str(args.sync_d_model),
                     "--sync-layers", str(args.sync_layers)]
    logs = [(tmp / f"sync{i}.log").open("w") for i in range(args.processes)]
    procs = [subprocess.Popen(cmd(i), stdout=logs[i], stderr=subprocess.STDOUT, env=_env(),
                              start_new_session=True) for i in range(args.processes)]
    try:
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
        for f in logs:
            f.close()
    out0 = (tmp / "sync0.log").read_text()
    line = next((x for x in out0.splitlines() if x.startswith("SYNC ")), None)
    if any(codes) or line is None:
        raise RuntimeError(f"sync benchmark failed {codes}:\n{out0[-3000:]}")
    data = json.loads(line[5:])
    res: dict = {"bytes": data["bytes"]}
    for kind in ("in_process", "cross_process", "host_staged"):
        # Cross-process: the receiving processes' times (process 0's rank is in-process).
        rows = [r for r in data["rows"] if r["kind"] == kind
                and (kind != "cross_process" or r["process"] != 0)]
        res[kind] = statistics.median(r["bytes"] / r["s"] / 1e9 for r in rows)
    return res


# ---------------------------------------------------------------------------------- 2. the job
def run_job(procs: int, world: int, steps: int, run_dir: Path, log_dir: Path) -> float:
    """The job laid out for `world` hosts, run on `procs` processes (1: one process with all
    `world` × 4 devices). Returns its wall time."""
    from tiderl.runtime.localworld import LocalWorld

    args = [f"run_dir={run_dir}", f"controller.steps={steps}",
            f"controller.checkpoint_every={steps}", f"rollout.ranks={world}",
            f"trainer.actor_devices={2 * world}", *JOB]
    t0 = time.perf_counter()
    if procs == 1:
        log_dir.mkdir(parents=True, exist_ok=True)
        with (log_dir / "process0.log").open("w") as log:
            p = subprocess.run([sys.executable, "-m", "tiderl.launch",
                                f"cluster.fake_cpu_devices={LOCAL_DEVICES * world}", *args],
                               stdout=log, stderr=subprocess.STDOUT, env=_env(), timeout=3600,
                               check=False, start_new_session=True)
        codes = [p.returncode]
    else:
        with LocalWorld(procs, [f"cluster.fake_cpu_devices={LOCAL_DEVICES}", *args],
                        log_dir=log_dir, env=_env()) as w:
            codes = w.wait(3600)
    if any(codes):
        raise RuntimeError(f"job on {procs} process(es) failed {codes}; logs in {log_dir}")
    return time.perf_counter() - t0


def step_split(run_dir: Path) -> dict:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["kind"] == "step"][1:]  # the first step compiles
    keys = ("step_time_s", "time_actor_fwd", "time_actor_bwd", "time_apply", "time_ref",
            "sync_s", "twt_s", "sync_local_gbps", "sync_cross_gbps")
    return {k: statistics.median(r[k] for r in recs if r.get(k) is not None)
            for k in keys if any(r.get(k) is not None for r in recs)}


def max_param_diff(a: Path, b: Path, step: int) -> float:
    import jax
    import numpy as np

    from tiderl.export import load_run_params

    def leaves(run: Path) -> dict:
        tree = load_run_params(run, step).params
        return {jax.tree_util.keystr(k): np.asarray(x)
                for k, x in jax.tree_util.tree_leaves_with_path(tree)}

    x, y = leaves(a), leaves(b)
    return max(float(np.max(np.abs(x[k] - y[k])) / max(np.max(np.abs(x[k])), 1e-12))
               for k in x)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sync-d-model", type=int, default=512)
    p.add_argument("--sync-layers", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="3 steps, 3 repeats, a small policy")
    p.add_argument("--sync-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.sync_worker:
        sync_worker(args)
        return 0
    if args.quick:
        args.steps, args.repeats, args.sync_d_model, args.sync_layers = 3, 3, 256, 2
    n = args.processes
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        sync = bench_sync(args, tmp)
        print(f"weight sync of {sync['bytes'] / 1e6:.1f} MB ({n} processes, medians of "
              f"{args.repeats}): in-process {sync['in_process']:.2f} GB/s, cross-process "
              f"{sync['cross_process']:.2f} GB/s, host-staged (in-process) "
              f"{sync['host_staged']:.2f} GB/s; cross/in-process "
              f"{sync['cross_process'] / sync['in_process']:.2f}", flush=True)
        walls = {n: run_job(n, n, args.steps, tmp / f"job{n}", tmp / f"logs{n}"),
                 1: run_job(1, n, args.steps, tmp / "job1", tmp / "logs1")}
        diff = max_param_diff(tmp / "job1", tmp / f"job{n}", args.steps)
        split = {k: step_split(tmp / f"job{k}") for k in (n, 1)}
    print(f"\njob, {args.steps} steps: max relative parameter difference {n} processes vs one "
          f"process: {diff:.3g}")
    keys = sorted(set(split[n]) | set(split[1]))
    print(f"{'median per step (s; GB/s)':28s}{f'{n} processes':>14s}{'1 process':>12s}")
    for k in keys:
        a, b = split[n].get(k, float("nan")), split[1].get(k, float("nan"))
        print(f"{k:28s}{a:14.4f}{b:12.4f}")
    print(f"{'job wall (s)':28s}{walls[n]:14.1f}{walls[1]:12.1f}")
    out = {"processes": n, "max_param_diff_vs_single": diff,
           "sync_gbps": {"in_process": sync["in_process"], "cross_process": sync["cross_process"],
                         "host_staged": sync["host_staged"]},
           "sync_bytes": sync["bytes"], "repeats": args.repeats, "steps": args.steps,
           "step_split": {"multi": split[n], "single": split[1]},
           "job_wall_s": {"multi": walls[n], "single": walls[1]}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
