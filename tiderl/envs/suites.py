"""Registry of environment suites: name or `package.module:Class` -> adapter class, imported only
when used; and `load_object` for the other user code a run names (reward and agent functions).
No JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

from tiderl.configlib import ConfigError
from tiderl.envs.adapters.base import Adapter

SUITES: dict[str, str] = {
    "default": "tiderl.envs.adapters.default:GuessNumber",
    "gym": "tiderl.envs.adapters.gym:GymText",
    "textworld": "tiderl.envs.adapters.textworld:TextWorldGame",
    "textarena": "tiderl.envs.adapters.textarena:TextArenaGame",
    "gui": "tiderl.envs.adapters.gui:GuiDesktop",
}

# What to install for each optional suite, named in the error when it is missing.
_EXTRAS = {"gym": "gymnasium", "textworld": "textworld", "textarena": "textarena"}


def load_object(spec: str, key: str) -> Any:
    """The object named `package.module:attr` (attr may be dotted); a ConfigError naming `key`
    and what went wrong otherwise."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"config key '{key}'={spec!r} is not 'package.module:name'")
    try:
        obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ConfigError(f"config key '{key}'={spec!r}: cannot import {module!r} ({e}); put its "
                          "package on PYTHONPATH or pip install it") from e
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise ConfigError(f"config key '{key}'={spec!r}: importing {module!r} failed "
                          f"({type(e).__name__}: {e})") from e
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"config key '{key}'={spec!r}: {module!r} has no {name!r}")
        obj = getattr(obj, part)
    return obj


def adapter_class(suite: str) -> type[Adapter]:
    """The adapter class of `suite` (a built-in name, '' for the default task, or
    `package.module:Class`); a clear error if the suite or its package is missing."""
    suite = suite or "default"
    if ":" in suite:
        cls = load_object(suite, "env.suite")
        if not (isinstance(cls, type) and issubclass(cls, Adapter)):
            raise ConfigError(f"config key 'env.suite'={suite!r} is a {type(cls).__name__}, not "
                              "a subclass of tiderl.envs.Adapter; point it at your adapter class")
        return cls
    if suite not in SUITES:
        raise ValueError(f"unknown env suite {suite!r}; use one of {', '.join(SUITES)} or "
                         "package.module:Class")
    module, name = SUITES[suite].split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"env suite {suite!r} needs the package {_EXTRAS.get(suite, e.name)!r}: "
            f"pip install {_EXTRAS.get(suite, e.name)} ({e})") from e
    return getattr(mod, name)
