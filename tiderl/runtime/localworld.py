"""Several processes of one job on this machine, joined over loopback: how the tests and
`benchmarks/multihost.py` run a multi-host job without hosts (fake CPU devices, gloo).

    with LocalWorld(2, ["cluster.fake_cpu_devices=4", ...], log_dir=tmp) as w:
        codes = w.wait(timeout=600)

Each process is `python -m tiderl.launch --coordinator 127.0.0.1:PORT --num-processes N
--process-id I ARGS...` in a session of its own, its output in `log_dir/process<I>.log`.
Leaving the block kills every process group that is still running (no orphans, whatever
happened inside), so a failing test never leaves a half-world behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tiderl.runtime.world import free_port


class LocalWorld:
    def __init__(self, n: int, args: Sequence[str], *, log_dir: str | Path,
                 env: dict[str, str] | None = None, port: int | None = None,
                 extra: Sequence[Sequence[str]] | None = None):
        self.n, self.args = n, list(args)
        self.log_dir = Path(log_dir)
        self.port = port or free_port()
        self.env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore",
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        self.extra = extra or [[] for _ in range(n)]
        self.procs: list[subprocess.Popen] = []

    def command(self, i: int) -> list[str]:
        return [sys.executable, "-m", "tiderl.launch", "--coordinator",
                f"127.0.0.1:{self.port}", "--num-processes", str(self.n), "--process-id",
                str(i), *self.args, *self.extra[i]]

    def start(self) -> LocalWorld:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.n):
            out = (self.log_dir / f"process{i}.log").open("w")
            self.procs.append(subprocess.Popen(self.command(i), stdout=out,
                                               stderr=subprocess.STDOUT, env=self.env,
                                               start_new_session=True))
            out.close()
        return self

    def __enter__(self) -> LocalWorld:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def log(self, i: int) -> str:
        path = self.log_dir / f"process{i}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def wait(self, timeout: float) -> list[int]:
        """Exit codes of all processes; kills them all (and raises) past `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = self.poll()
            if all(c is not None for c in codes):
                return [int(c) for c in codes]  # type: ignore[arg-type]  # all set here
            time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"the {self.n} processes did not end within {timeout:g} s; "
                           f"logs in {self.log_dir}")

    def kill_process(self, i: int, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.procs[i].pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                self.kill_process(i)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
