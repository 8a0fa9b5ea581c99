"""`python -m tiderl.envs serve --suite NAME|--adapter package.module:Class --port N`: run an env
server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

from tiderl.configlib import ConfigError, apply_overrides, from_dict
from tiderl.envs.config import EnvConfig, with_default_token


def parse(argv: list[str] | None = None) -> EnvConfig:
    return parse_args(argv)[0]


def parse_args(argv: list[str] | None = None) -> tuple[EnvConfig, str]:
    """(the server's EnvConfig, its --state-dir or '')."""
    p = argparse.ArgumentParser(prog="python -m tiderl.envs", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve one env suite over HTTP")
    s.add_argument("--suite", default="default", help="default | gym | textworld | textarena | gui")
    s.add_argument("--adapter", default="", metavar="package.module:Class",
                   help="serve your own Adapter subclass (instead of --suite)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    s.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (printed)")
    s.add_argument("--token", default="", help="require this bearer token on every route")
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="suite option, repeatable (e.g. --option game=Taxi-v4)")
    s.add_argument("--state-dir", default="", metavar="DIR",
                   help="the server's folder for adapter files such as TextWorld's compiled "
                        "games (kept across restarts); default: a private temporary folder, "
                        "removed at exit")
    s.add_argument("overrides", nargs="*", metavar="env.KEY=VALUE",
                   help="EnvConfig overrides, e.g. idle_timeout_s=60 latency.dist=lognormal")
    args = p.parse_args(argv)
    if args.adapter and ":" not in args.adapter:
        raise ConfigError(f"--adapter {args.adapter!r} is not package.module:Class")
    data = {"suite": args.adapter or args.suite, "host": args.host, "port": args.port, "token": args.token,
            "options": list(args.option)}
    overrides = [o.removeprefix("env.") for o in args.overrides]
    return (from_dict(EnvConfig, apply_overrides(EnvConfig, data, overrides), prefix="env"),
            args.state_dir)


async def serve(cfg: EnvConfig, state_dir: str = "") -> None:
    from tiderl.envs.server import EnvServer
    from tiderl.envs.suites import adapter_class

    cfg, generated = with_default_token(cfg)
    server = EnvServer(adapter_class(cfg.suite), cfg, state_dir=state_dir or None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with server.serve() as url:
        # The first stdout line is the URL, so scripts can start us on port 0 and read it.
        # Off loopback without --token a token is generated: clients pass it as env.token.
        token = f" token={cfg.token}" if generated else ""
        print(f"tiderl env server: suite={cfg.suite} url={url}{token}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    from tiderl.control.logs import setup_logging

    setup_logging()
    try:
        cfg, state_dir = parse_args(argv)
        if ":" in cfg.suite:  # the user's class: import it now, so a bad name is one line
            from tiderl.envs.suites import adapter_class

            adapter_class(cfg.suite)
        # A bad suite option is a ConfigError from the server's startup, before it listens.
        asyncio.run(serve(cfg, state_dir))
    except ConfigError as e:
        print(f"tiderl.envs: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
