"""A thin parent for each process of a multi-process job, so that its end is one clear line.

When process 0 dies, the coordination service (which lives in it) goes too, and JAX's client
in every other process aborts at once from a C++ thread with a fatal log and a stack trace —
nothing in the process can turn that into a message (its callback is not reachable from
Python). So `python -m tiderl.launch` with a coordinator runs the job in a child process and
watches it: the child's stderr passes through, and if the child was aborted by JAX's
coordination client, the fatal block is held back and replaced by one line naming process 0
(exit code 4, as when the watchdog stops a process for a dead peer). Signals (SIGINT,
SIGTERM, SIGHUP) are forwarded; the child dies with its parent (PR_SET_PDEATHSIG). No JAX.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from tiderl.runtime.world import EXIT_PEER_LOST

ENV = "TIDERL_SUPERVISED"
FATAL = b"Terminating process because the JAX distributed service detected fatal errors"


def supervised() -> bool:
    """Whether this process is already the job (the child), not its parent."""
    return os.environ.get(ENV) == "1"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's signal handlers still forward
        pass


def supervise(argv: Sequence[str], *, coordinator: str, process_id: int | None,
              run_dir: str) -> int:
    """Runs `python -m tiderl.launch ARGV` as a child and returns its exit code."""
    child = subprocess.Popen([sys.executable, "-m", "tiderl.launch", *argv],
                             env={**os.environ, ENV: "1"}, stderr=subprocess.PIPE,
                             preexec_fn=_die_with_parent)

    def forward(sig: int, _frame: object) -> None:
        if child.poll() is None:
            child.send_signal(sig)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    held: list[bytes] = []
    tail: collections.deque[bytes] = collections.deque(maxlen=50)
    assert child.stderr is not None
    for line in iter(child.stderr.readline, b""):
        if held or FATAL in line:
            held.append(line)  # JAX's fatal block and its stack trace: summarised below
            continue
        tail.append(line)
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
    rc = child.wait()
    if held:
        who = f"process {process_id}" if process_id is not None else "this process"
        print(f"tiderl: stopped: process 0 (the coordinator at {coordinator}) died or became "
              f"unreachable, so JAX's coordination client stopped {who}; the checkpoints in "
              f"{run_dir}/checkpoints are intact: restart every process with --resume "
              f"{run_dir}", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    return rc if rc >= 0 else 128 - rc
