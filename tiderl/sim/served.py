"""The default task's env server in a process of its own, as a deployed environment runs beside
a training job: for the validation job that serves its env so (`tiderl.sim.validate`, job
`served`) and for the host cost of its calls (`tiderl.sim.hostcost`). No JAX.

`ServedEnv(overrides)` starts `python -m tiderl.sim.served OUT serve --suite default
OVERRIDES...` on a free loopback port, gives its URL, and when closed stops it and reads what it
wrote to OUT: the actions its adapter received (`trace`: {(task id, turn): action text}, the
policy's actions, replayed by the simulated twin) and the process's CPU seconds while it served
(`cpu_s`: from listening to being told to stop; start-up and shut-down left out).

`ActionRecorder` records those actions where the adapter runs: in this process for an env served
in-process, in the server's process here.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class ActionRecorder:
    """Records the policy's actions as the default task's adapter receives them, in this
    process: {(task id, turn): action text}."""

    def __init__(self) -> None:
        from tiderl.envs.adapters.default import GuessNumber

        self.cls, self.trace = GuessNumber, {}
        self._reset, self._step = GuessNumber.reset, GuessNumber.step

    def __enter__(self) -> dict[tuple[str, int], str]:
        rec, reset, step = self.trace, self._reset, self._step

        def traced_reset(adapter, task):
            adapter._trace_id = str(task.get("task_id"))
            return reset(adapter, task)

        def traced_step(adapter, action):
            rec[(getattr(adapter, "_trace_id", ""), adapter.used)] = action
            return step(adapter, action)

        self.cls.reset, self.cls.step = traced_reset, traced_step
        return rec

    def __exit__(self, *exc: object) -> None:
        self.cls.reset, self.cls.step = self._reset, self._step


class ServedEnv:
    """The default task served by a process of its own; `overrides` are its EnvConfig's
    (`latency.dist=pareto`, ...). `url` while open; after `close()`, `trace` and `cpu_s`."""

    def __init__(self, overrides: list[str] | tuple[str, ...] = (), *, start_timeout_s: float = 60):
        self.overrides, self.start_timeout_s = list(overrides), start_timeout_s
        self.url = ""
        self.trace: dict[tuple[str, int], str] = {}
        self.cpu_s = float("nan")
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> ServedEnv:
        self._dir = tempfile.TemporaryDirectory(prefix="tiderl-served-")
        d = Path(self._dir.name)
        with (d / "served.log").open("w") as log:  # its log to a file: a pipe could fill up
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tiderl.sim.served", str(d / "served.json"), "serve",
                 "--suite", "default", *self.overrides],
                stdout=subprocess.PIPE, stderr=log, text=True, env=_env_with_package())
        line = self._proc.stdout.readline() if self._proc.stdout else ""  # the URL line
        if "url=" not in line:
            self._proc.kill()
            self._proc.communicate()  # waits, and closes its stdout pipe
            err = (d / "served.log").read_text().strip()[-2000:]
            self._dir.cleanup()
            raise RuntimeError(f"the env server process did not start (exit code "
                               f"{self._proc.returncode}) with overrides {self.overrides}: "
                               f"{err or line.strip()}")
        self.url = line.split("url=", 1)[1].split()[0]
        return self

    def close(self) -> None:
        proc, d = self._proc, self._dir
        if proc is None or d is None:
            return
        self._proc = self._dir = None
        try:
            proc.terminate()  # SIGTERM: the server stops serving and writes its file
            try:
                proc.communicate(timeout=self.start_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            out = Path(d.name) / "served.json"
            if not out.is_file():
                err = (Path(d.name) / "served.log").read_text().strip()[-2000:]
                raise RuntimeError(f"the env server process (exit code {proc.returncode}) "
                                   f"wrote no trace: {err}")
            data = json.loads(out.read_text())
            self.trace = {(t, k): a for t, k, a in data["trace"]}
            self.cpu_s = float(data["cpu_s"])
        finally:
            d.cleanup()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _env_with_package() -> dict[str, str]:
    """This process's environment, with the folder this `tiderl` was imported from first on
    the child's path (the child then runs this same code, installed or not)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def main(argv: list[str] | None = None) -> int:
    """`python -m tiderl.sim.served OUT serve ...`: `python -m tiderl.envs serve ...` with its
    adapter's actions recorded and its CPU time while serving taken; at exit writes {"trace",
    "cpu_s"} to OUT."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        print("usage: python -m tiderl.sim.served OUT serve [env server arguments]",
              file=sys.stderr)
        return 2
    out, rest = Path(argv[0]), argv[1:]
    from tiderl.envs import __main__ as envs_main
    from tiderl.envs.server import EnvServer

    serve, marks = EnvServer.serve, {}

    @contextlib.asynccontextmanager
    async def timed_serve(server: EnvServer, *args: object, **kwargs: object):
        async with serve(server, *args, **kwargs) as url:
            marks["ready"] = time.process_time()
            try:
                yield url
            finally:
                marks["stop"] = time.process_time()

    EnvServer.serve = timed_serve  # type: ignore[method-assign]
    with ActionRecorder() as trace:
        rc = envs_main.main(rest)
    cpu = marks["stop"] - marks["ready"] if "stop" in marks else float("nan")
    out.write_text(json.dumps({"trace": [[t, k, a] for (t, k), a in trace.items()],
                               "cpu_s": cpu}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
