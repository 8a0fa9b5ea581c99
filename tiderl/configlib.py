"""Typed config machinery: frozen dataclass trees from YAML and dotted overrides. No JAX.

Component configs are frozen keyword-only dataclasses that live next to what they configure;
`tiderl.config.RunConfig` composes them. This module turns plain data (YAML, `a.b=c` strings)
into those dataclasses and rejects unknown keys and wrong types with a message that names the
key and the fix, before any work starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import types
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")

# Host names that only this machine can reach: a server bound to one of them needs no token.
# "[::1]" is how an IPv6 loopback appears inside a URL or a host:port pair.
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


class ConfigError(ValueError):
    """A config input is wrong; the message names the key and the fix."""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is tuple:
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_name(args[0])}"
        return "tuple"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks `value` against the annotation `tp`, converting only where it is lossless."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        errors = []
        for arm in get_args(tp):
            try:
                return _coerce(value, arm, key)
            except ConfigError as e:
                errors.append(e)
        raise _type_error(value, tp, key)
    if origin is Literal:
        if value in get_args(tp) and not isinstance(value, bool):
            return value
        if isinstance(value, bool) and ("on" if value else "off") in get_args(tp):
            return "on" if value else "off"  # YAML 1.1 reads on/off as booleans
        raise ConfigError(
            f"config key '{key}': {value!r} is not one of {_type_name(tp)}; "
            f"set {key} to one of them"
        )
    if origin is tuple:
        args = get_args(tp)
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise _type_error(value, tp, key)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise _type_error(value, tp, key)
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
        raise _type_error(value, tp, key)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"config key '{key}': expected a mapping of {tp.__name__} fields, got {value!r}"
            )
        return from_dict(tp, value, prefix=key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(value, tp, key)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(value, tp, key)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "1e-5" (no dot) as a string; accept what float() accepts.
            with contextlib.suppress(ValueError):
                return float(value)
        raise _type_error(value, tp, key)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(value, tp, key)
    raise ConfigError(f"config key '{key}': unsupported annotation {tp!r} (a bug in tiderl)")


def _type_error(value: Any, tp: Any, key: str) -> ConfigError:
    return ConfigError(
        f"config key '{key}': expected {_type_name(tp)}, got {value!r} "
        f"({type(value).__name__}); set {key} to a value of type {_type_name(tp)}"
    )


def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=False)


def from_dict(cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Builds the dataclass `cls` from nested plain data, checking keys and types."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"config '{prefix or '<root>'}' must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise unknown_key(key, prefix, list(fields))
        kwargs[name] = _coerce(value, hints[name], key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config '{prefix or '<root>'}': {e}") from e


def unknown_key(key: str, prefix: str, known: Sequence[str]) -> ConfigError:
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, known, n=1)
    where = f"'{prefix}'" if prefix else "the run config"
    hint = f"did you mean '{(prefix + '.') if prefix else ''}{close[0]}'?" if close else (
        f"known keys of {where}: {', '.join(sorted(known))}"
    )
    return ConfigError(f"unknown config key '{key}'; {hint}")


def to_dict(cfg: Any) -> Any:
    """The plain-data form of a config tree (tuples become lists), for YAML and JSON."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg


def parse_override(text: str) -> tuple[list[str], Any]:
    """Splits `a.b.c=value` into its path and a YAML-parsed value."""
    if "=" not in text:
        raise ConfigError(
            f"override {text!r} is not of the form key=value; write e.g. trainer.lr=1e-5"
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key; write e.g. trainer.lr=1e-5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from e
    return key.split("."), value


def apply_overrides(cls: type, data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Writes each `a.b=c` into the nested dict `data`, checking the path against `cls`."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        klass: Any = cls
        for depth, part in enumerate(path):
            key = ".".join(path[: depth + 1])
            prefix = ".".join(path[:depth])
            if not (dataclasses.is_dataclass(klass)):
                raise ConfigError(f"config key '{key}': '{prefix}' is not a section")
            fields = {f.name for f in dataclasses.fields(klass)}
            if part not in fields:
                raise unknown_key(key, prefix, sorted(fields))
            sub_tp = _hints(klass)[part]
            if depth == len(path) - 1:
                node[part] = value
            else:
                if not dataclasses.is_dataclass(sub_tp):
                    raise ConfigError(f"config key '{key}' is a value, not a section; "
                                      f"write {key}=VALUE")
                child = node.get(part)
                if not isinstance(child, dict):
                    child = {}
                    node[part] = child
                node = child
                klass = sub_tp
    return data


def load_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"config file {path!r} not found; pass an existing --config") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping at the top level")
    return data


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merges `over` into a copy of `base` (mappings merge, everything else replaces)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


__all__ = [
    "ConfigError",
    "apply_overrides",
    "dump_yaml",
    "from_dict",
    "load_yaml",
    "merge",
    "parse_override",
    "to_dict",
]
