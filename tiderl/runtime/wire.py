"""Messages between the processes of one job: JSON plus raw numpy buffers, never pickle. No JAX.

A message is a dict of JSON values and numpy arrays (at any depth). `encode` writes a 4-byte
header length, a JSON header in which every array is replaced by `{"__nd__": i}`, the arrays'
dtype/shape table, then the arrays' bytes back to back; `decode` reverses it with
`np.frombuffer` (copies, so the message buffer can be dropped). Only numeric dtypes travel:
an object array (which would need pickle) is refused.

The rollout side's host records (`Prefix`, `TurnResult`, `Handoff`) have their own plain-data
forms below, so a task can move between ranks of different processes with exactly its tokens.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import numpy as np

from tiderl.serving.pages import Prefix, StopReason
from tiderl.serving.rank import Handoff, RankStats, TurnResult

_ND = "__nd__"


def encode(msg: dict[str, Any]) -> bytes:
    arrays: list[np.ndarray] = []

    def walk(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            if x.dtype.hasobject:
                raise TypeError("object arrays cannot travel between processes (no pickle); "
                                "send numeric arrays or plain lists")
            arrays.append(np.ascontiguousarray(x))
            return {_ND: len(arrays) - 1}
        if isinstance(x, dict):
            return {str(k): walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        if isinstance(x, np.generic):
            return x.item()
        return x

    body = walk(msg)
    table = [[a.dtype.str, list(a.shape)] for a in arrays]
    head = json.dumps({"body": body, "arrays": table}, separators=(",", ":")).encode()
    return b"".join([struct.pack("<I", len(head)), head, *(a.tobytes() for a in arrays)])


def decode(buf: bytes) -> dict[str, Any]:
    (n,) = struct.unpack_from("<I", buf, 0)
    head = json.loads(buf[4:4 + n])
    arrays, off = [], 4 + n
    for dtype, shape in head["arrays"]:
        dt = np.dtype(dtype)
        count = int(np.prod(shape)) if shape else 1
        arrays.append(np.frombuffer(buf, dt, count, off).reshape(shape).copy())
        off += count * dt.itemsize

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if set(x) == {_ND}:
                return arrays[x[_ND]]
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(head["body"])


# -- rollout records -----------------------------------------------------------------------------
def prefix_to_wire(p: Prefix | None) -> dict | None:
    if p is None:
        return None
    d = dataclasses.asdict(p)
    d["stop_reason"] = int(p.stop_reason)
    return d


def prefix_from_wire(d: dict | None) -> Prefix | None:
    if d is None:
        return None
    d = dict(d)
    d["stop_reason"] = StopReason(d["stop_reason"])
    return Prefix(**d)


def result_to_wire(r: TurnResult | None) -> dict | None:
    if r is None:
        return None
    d = dataclasses.asdict(r)
    d["stop_reason"] = int(r.stop_reason)
    return d


def result_from_wire(d: dict | None) -> TurnResult | None:
    if d is None:
        return None
    d = dict(d)
    d["stop_reason"] = StopReason(d["stop_reason"])
    return TurnResult(**d)


def handoff_to_wire(h: Handoff) -> dict:
    return {"prefix": prefix_to_wire(h.prefix), "unfed": h.unfed,
            "result": result_to_wire(h.result)}


def handoff_from_wire(d: dict) -> Handoff:
    return Handoff(prefix_from_wire(d["prefix"]), d["unfed"], result_from_wire(d["result"]))


def stats_to_wire(s: RankStats) -> dict:
    return dataclasses.asdict(s)


def stats_from_wire(d: dict) -> RankStats:
    return RankStats(**d)
