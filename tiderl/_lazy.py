"""PEP 562 lazy re-exports: packages name their public API without importing JAX at import."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def lazy_exports(package: str, table: Mapping[str, str]):
    """Returns (`__getattr__`, `__dir__`) resolving `name` from `table[name]` on first use."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(table[name]), name)

    def __dir__() -> list[str]:
        return sorted(table)

    return __getattr__, __dir__
