"""Is env.url's server there? Asked before any work (stdlib only: launch runs it before the
heavy imports, so a wrong URL fails within seconds). No JAX."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from tiderl.envs.config import EnvConfig


def probe_health(url: str, cfg: EnvConfig | None = None, *, deadline_s: float = 3.0
                 ) -> str | None:
    """None when `url`'s GET /health answers 200 within `deadline_s`, else why not (one line).
    A refused connection is retried for a second (a server still binding its port), a server
    that accepts but does not answer gets the whole deadline."""
    cfg = cfg or EnvConfig()
    headers = {"Authorization": f"Bearer {cfg.token}"} if cfg.token else {}
    start = time.monotonic()
    end = start + deadline_s
    why = f"no reply within {deadline_s:g}s"
    while (left := end - time.monotonic()) > 0:
        req = urllib.request.Request(url.rstrip("/") + "/health", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=left) as resp:
                json.loads(resp.read() or b"{}")
                return None
        except urllib.error.HTTPError as e:
            why = f"HTTP {e.code} {e.read()[:200].decode(errors='replace').strip()}"
            if e.code in (401, 403):
                return why + " (set env.token to the server's token)"
            if e.code == 404:
                return why + " (not a tiderl env server?)"
        except (TimeoutError, OSError, ValueError) as e:  # URLError is an OSError
            reason = getattr(e, "reason", e)
            why = f"{type(reason).__name__}: {reason}"
            if isinstance(reason, ConnectionRefusedError) and time.monotonic() - start > 1.0:
                break
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))
    return " ".join(why.split())


def env_url_error(cfg: EnvConfig, *, deadline_s: float = 3.0) -> str | None:
    """None when the run needs no env server or env.url's /health answers; else the one-line
    error naming env.url (launch fails with it before any other work)."""
    if not cfg.url or cfg.kind != "env":
        return None
    why = probe_health(cfg.url, cfg, deadline_s=deadline_s)
    if why is None:
        return None
    return (f"config key 'env.url'={cfg.url!r}: no env server answered GET {cfg.url.rstrip('/')}"
            f"/health within {deadline_s:g}s ({why}); start one (python -m tiderl.envs serve "
            "--port N) or fix env.url")
