"""Console logging for every entry point (`tiderl.launch`, `tiderl.report`, `tiderl.export`,
`tiderl.envs serve`, `tiderl.sim.run`). No JAX.

tiderl's own messages (info and up) and everyone's warnings reach the console. On a terminal
they go through rich, above the live progress line; otherwise (a pipe, a log file, CI) one
plain, unwrapped, timestamped line each on stderr, so logs stay greppable.
"""

from __future__ import annotations

import logging
import sys


class _PlainHandler(logging.StreamHandler):
    """tiderl's handler when stderr is not a terminal (told apart from basicConfig's). It
    writes to whatever `sys.stderr` is at the time (as rich's console follows sys.stdout), so
    a redirected or captured stderr gets the lines, never a stream closed since."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]  # an attribute in StreamHandler, a live view here
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler assigns it; the property wins
        pass


def console_is_terminal() -> bool:
    from rich import get_console

    return get_console().is_terminal


def setup_logging() -> None:
    """Installs one console handler on the root logger (idempotent); tiderl logs at INFO."""
    root = logging.getLogger()
    # A library's module-level logging.warning() may have installed a plain stderr handler
    # (logging.basicConfig's); with it every message would print twice.
    for h in list(root.handlers):
        if type(h) is logging.StreamHandler:
            root.removeHandler(h)
    from rich.logging import RichHandler

    if not any(isinstance(h, (RichHandler, _PlainHandler)) for h in root.handlers):
        if console_is_terminal():
            handler: logging.Handler = RichHandler(show_path=False, log_time_format="[%X]")
            handler.setFormatter(logging.Formatter("%(message)s"))
        else:
            handler = _PlainHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s",
                                                   datefmt="%H:%M:%S"))
        root.addHandler(handler)
    if root.level > logging.WARNING or root.level == logging.NOTSET:
        root.setLevel(logging.WARNING)
    logging.getLogger("tiderl").setLevel(logging.INFO)
