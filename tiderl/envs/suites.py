"""Registry of environment suites: name -> adapter class, imported only when used. No JAX."""

from __future__ import annotations

import importlib

from tiderl.envs.adapters.base import Adapter

SUITES: dict[str, str] = {
    "default": "tiderl.envs.adapters.default:GuessNumber",
    "gym": "tiderl.envs.adapters.gym:GymText",
    "textworld": "tiderl.envs.adapters.textworld:TextWorldGame",
    "textarena": "tiderl.envs.adapters.textarena:TextArenaGame",
}

# What to install for each optional suite, named in the error when it is missing.
_EXTRAS = {"gym": "gymnasium", "textworld": "textworld", "textarena": "textarena"}


def adapter_class(suite: str) -> type[Adapter]:
    """The adapter class of `suite`; a clear error if the suite or its package is missing."""
    if suite not in SUITES:
        raise ValueError(f"unknown env suite {suite!r}; use one of {', '.join(SUITES)}")
    module, name = SUITES[suite].split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"env suite {suite!r} needs the package {_EXTRAS.get(suite, e.name)!r}: "
            f"pip install {_EXTRAS.get(suite, e.name)} ({e})") from e
    return getattr(mod, name)
