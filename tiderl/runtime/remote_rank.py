"""Rollout ranks on other processes, driven through the same `RolloutRank` contract. No JAX.

The controller (process 0) sees every rollout rank as an object with the `RolloutRank` API:
its own ranks are `RolloutRank`s, each other process's are `RemoteRank`s, so the scheduler
and the episode runners never know where a rank lives. A `RemoteRank` forwards each call as a
message on the "rank" stream to that process's `HostAgent`, which owns the real `RolloutRank`s
(engines on its own devices, driven only by it) and answers on the "reply" stream. Streams are
ordered, so a task's turn, pause, resume, release and finish arrive in the order they were
made. Tasks migrating between processes carry their `Handoff` in plain data (`tiderl.runtime.wire`).

Weights are not messages: the sync unit of the plan stream moves them device to device
(`tiderl.runtime.weightsync`), and the agent acks each rank's swap ("swapped"), which is what
`RemoteRank.update_weights` waits for.

Sends never block the event loop: each direction has a sender thread (a key-value store write
is a gRPC call), and each receiving side one thread per stream that posts to the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

from tiderl.runtime import wire
from tiderl.runtime.channel import ChannelClosed
from tiderl.serving.rank import RankFailedError, RankStats, RolloutRank

log = logging.getLogger(__name__)

RANK, REPLY = "rank", "reply"


class _Sender:
    """A thread that writes queued messages to one stream (keeps gRPC off the event loop)."""

    def __init__(self, channel: Any, dst: int, stream: str):
        self.q: queue.Queue = queue.Queue()
        self.channel, self.dst, self.stream = channel, dst, stream
        self.thread = threading.Thread(target=self._run, name=f"tiderl-send-{stream}-{dst}",
                                       daemon=True)
        self.thread.start()

    def send(self, msg: dict) -> None:
        self.q.put(msg)

    def _run(self) -> None:
        while (msg := self.q.get()) is not None:
            try:
                self.channel.send(self.dst, self.stream, msg)
            except Exception:  # the world is going down; the watchdog says why
                log.exception("could not send to process %d", self.dst)
                return

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=10)


def _receive(channel: Any, src: int, stream: str, loop: asyncio.AbstractEventLoop,
             handle: Any) -> threading.Thread:
    def run() -> None:
        while True:
            try:
                msg = channel.recv(src, stream)
            except ChannelClosed:
                return
            except Exception:  # noqa: BLE001 - the world is going down; the watchdog says why
                log.exception("receiving %s from process %d failed", stream, src)
                return
            try:
                loop.call_soon_threadsafe(handle, src, msg)
            except RuntimeError:  # the loop closed
                return

    t = threading.Thread(target=run, name=f"tiderl-recv-{stream}-{src}", daemon=True)
    t.start()
    return t


# ------------------------------------------------------------------------------------- leader
class Router:
    """Process 0's end of the rank streams: one sender and one receiver per other process."""

    def __init__(self, world: Any):
        self.world = world
        self.channel = world.channel()
        self.ranks: dict[int, RemoteRank] = {}
        self._senders: dict[int, _Sender] = {}
        self._started = False

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        loop = asyncio.get_running_loop()
        for k in range(1, self.world.size):
            self._senders[k] = _Sender(self.channel, k, RANK)
            _receive(self.channel, k, REPLY, loop, self._dispatch)

    def send(self, process: int, msg: dict) -> None:
        self._senders[process].send(msg)

    def _dispatch(self, src: int, msg: dict) -> None:
        rank = self.ranks.get(msg.get("rank", -1))
        if rank is not None:
            rank._on_reply(msg)

    def close(self) -> None:
        for s in self._senders.values():
            s.close()


class RemoteRank:
    """A rollout rank of another process, behind the `RolloutRank` API."""

    def __init__(self, rank_id: int, process: int, router: Router):
        self.rank_id, self.process, self.router = rank_id, process, router
        router.ranks[rank_id] = self
        self.stats = RankStats()
        self.failed: BaseException | None = None
        self._kv: dict[str, float] = {}
        self._version = 0
        self._turns: dict[int, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._swaps: dict[int, asyncio.Future] = {}
        self._started: asyncio.Future | None = None
        self._next = 0
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.router.start()
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
        self._send({"op": "hello"})
        await self._started

    async def close(self, timeout_s: float = 120.0) -> dict:
        """Closes the remote rank and hands back its tasks (as `RolloutRank.close`). A rank
        never started (the run failed before) only forgets; its agent ends with the plan."""
        if self._closed:
            return {}
        self._closed = True
        for fut in self._turns.values():
            if not fut.done():
                fut.cancel()
        if self._started is None:
            return {}
        try:
            handed = await asyncio.wait_for(self._call({"op": "close"}), timeout_s)
        except TimeoutError:
            log.warning("rank %d on process %d did not answer close within %g s", self.rank_id,
                        self.process, timeout_s)
            return {}
        return {int(k): wire.handoff_from_wire(v) for k, v in handed["handoffs"].items()}

    async def drain(self) -> dict:
        """Leaves rollout (ERS), as `RolloutRank.drain`: the remote turns in flight finish
        (their results arrive first), then the agent closes the rank and hands back its
        tasks."""
        if self._closed:
            return {}
        if self._started is None:
            self._closed = True
            return {}
        handed = await self._call({"op": "drain"})
        self._closed = True
        for fut in self._turns.values():
            if not fut.done():
                fut.cancel()
        return {int(k): wire.handoff_from_wire(v) for k, v in handed["handoffs"].items()}

    # -- the RolloutRank API --------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def live(self) -> bool:
        return self.failed is None and not self._closed

    def turn(self, task_id: int, new_tokens: Sequence[int], prefix: Any = None, *,
             sample_id: int | None = None, temperature: float | None = None,
             share_key: str | None = None,
             max_action_tokens: int | None = None,
             images: Sequence[Any] | None = None) -> asyncio.Future:
        if self.failed is not None:
            raise RankFailedError(f"rank {self.rank_id} is quarantined: {self.failed!r}")
        if images:
            raise ValueError(f"rank {self.rank_id} is on another process, and images do not "
                             "cross processes yet: run a vision-language policy's rollout "
                             "ranks on the controller's process (one host)")
        old = self._turns.get(task_id)
        if old is not None and not old.done():
            raise RuntimeError(f"task {task_id} already has a turn in flight on rank "
                               f"{self.rank_id}")
        fut = asyncio.get_running_loop().create_future()
        self._turns[task_id] = fut
        self._send({"op": "turn", "task": task_id, "tokens": [int(t) for t in new_tokens],
                    "prefix": wire.prefix_to_wire(prefix), "sample_id": sample_id,
                    "temperature": temperature, "share_key": share_key,
                    "max_action_tokens": max_action_tokens})
        return fut

    def pause(self, task_id: int, keep: float = 0.0) -> None:
        self._send({"op": "pause", "task": task_id, "keep": float(keep)})

    def resume(self, task_id: int) -> None:
        self._send({"op": "resume", "task": task_id})

    def finish(self, task_id: int) -> None:
        self._turns.pop(task_id, None)
        self._send({"op": "finish", "task": task_id})

    async def release(self, task_id: int) -> Any:
        self._turns.pop(task_id, None)
        if self._closed:  # close() handed every task back already
            return wire.handoff_from_wire({"prefix": None, "unfed": None, "result": None})
        reply = await self._call({"op": "release", "task": task_id})
        return wire.handoff_from_wire(reply["handoff"])

    async def update_weights(self, params: Any, version: int) -> dict | None:
        """Waits until the agent swapped in the weights the sync unit moved (version); returns
        its transfer stats. A failed rank returns at once (its weights no longer matter)."""
        if self.failed is not None:
            return None
        fut = self._swaps.setdefault(version, asyncio.get_running_loop().create_future())
        try:
            return await fut
        finally:
            self._swaps.pop(version, None)

    def kv_stats(self) -> dict[str, float]:
        return dict(self._kv)

    # -- messages -------------------------------------------------------------------------------
    def _send(self, msg: dict) -> None:
        self.router.send(self.process, {**msg, "rank": self.rank_id})

    async def _call(self, msg: dict) -> dict:
        self._next += 1
        fut = asyncio.get_running_loop().create_future()
        self._calls[self._next] = fut
        self._send({**msg, "req": self._next})
        return await fut

    def _on_reply(self, msg: dict) -> None:
        if "stats" in msg:
            self.stats = wire.stats_from_wire(msg["stats"])
            self._kv = msg.get("kv", {})
        if msg.get("failed") and self.failed is None:
            self.failed = RankFailedError(f"rank {self.rank_id} on process {self.process}: "
                                          f"{msg['failed']}")
        op = msg["op"]
        if op == "hello":
            if self._started is None:
                self._started = asyncio.get_running_loop().create_future()
            if not self._started.done():
                self._started.set_result(None)
        elif op == "turn":
            fut = self._turns.get(msg["task"])
            if fut is None or fut.done():
                return  # the episode went away meanwhile (cancelled, moved)
            if msg.get("error"):
                fut.set_exception(RankFailedError(msg["error"]) if msg.get("kind") == "failed"
                                  else RuntimeError(msg["error"]))
            else:
                fut.set_result(wire.result_from_wire(msg["result"]))
        elif op == "swapped":
            self._version = max(self._version, int(msg["version"]))
            fut = self._swaps.setdefault(int(msg["version"]),
                                         asyncio.get_running_loop().create_future())
            if not fut.done():
                fut.set_result(msg.get("sync"))
        elif op == "reply":
            fut = self._calls.pop(msg["req"], None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        if self.failed is not None:
            for fut in self._swaps.values():
                if not fut.done():
                    fut.set_result(None)


# ------------------------------------------------------------------------------------ follower
class HostAgent:
    """A follower's rollout ranks, served to the controller over the rank stream."""

    def __init__(self, world: Any, ranks: Sequence[RolloutRank], make_rank: Any = None):
        self.world = world
        self.channel = world.channel()
        self.ranks = {r.rank_id: r for r in ranks}
        self.make_rank = make_rank
        """(rank id, weights in its layout, version) -> a RolloutRank, not started: the ranks
        of cells joining rollout (`join`)."""
        self._hellos: set[int] = set()
        """Ranks the controller greeted before they were started here (answered once live)."""
        self._not_started: dict[int, str] = {}
        """Ranks whose start failed here: their hello is answered as failed."""
        self._done = asyncio.Event()
        self._out: _Sender | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bg: set[asyncio.Task] = set()

    async def serve(self) -> None:
        """Runs until the controller closes every rank (or `stop`)."""
        self._loop = asyncio.get_running_loop()
        self._out = _Sender(self.channel, 0, REPLY)
        for r in self.ranks.values():
            await r.start()
        _receive(self.channel, 0, RANK, self._loop, self._handle)
        await self._done.wait()
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        for r in list(self.ranks.values()):
            if not r._closed:  # the controller went away without closing it
                await r.close()
        self._out.close()

    def stop(self) -> None:
        """From any thread: the run is over."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._done.set)

    def weights(self, trees: dict, version: int, stats: dict) -> None:
        """From the control thread after a sync unit: swap each local rank's weights, then ack."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._swap_all, trees, version, stats)

    def join(self, trees: dict, version: int) -> None:
        """From the control thread after a role change: start a rank on each tree (cells
        joining rollout); the controller learns each is live from its "hello"."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(
            lambda: [self._spawn(self._start(rid, tree, version)) for rid, tree in trees.items()])

    async def _start(self, rid: int, tree: Any, version: int) -> None:
        if self.make_rank is None:
            raise RuntimeError("this host agent cannot start ranks (no make_rank)")
        try:
            rank = await asyncio.to_thread(self.make_rank, rid, tree, version)
            await rank.start()
        except Exception as e:  # its slot stays empty; the others serve on
            log.exception("rollout rank %d failed to start on process %d", rid,
                          self.world.process_id)
            self._not_started[rid] = repr(e)
            if rid in self._hellos:
                self._hellos.discard(rid)
                self._refuse(rid)
            return
        self._not_started.pop(rid, None)
        self.ranks[rid] = rank
        if rid in self._hellos:
            self._hellos.discard(rid)
            self._reply(rank, {"op": "hello"})

    def _refuse(self, rid: int) -> None:
        """Answers the controller's hello for a rank that could not start here (failed)."""
        assert self._out is not None
        self._out.send({"op": "hello", "rank": rid, "failed": self._not_started[rid],
                        "stats": wire.stats_to_wire(RankStats()), "kv": {}})

    def _swap_all(self, trees: dict, version: int, stats: dict) -> None:
        for rid, tree in trees.items():
            if rid in self.ranks:  # not a rank that failed to start
                self._spawn(self._swap(rid, tree, version, stats.get(rid)))

    async def _swap(self, rid: int, tree: Any, version: int, stats: dict | None) -> None:
        rank = self.ranks[rid]
        await rank.update_weights(tree, version)
        self._reply(rank, {"op": "swapped", "version": version, "sync": stats})

    def _spawn(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def _reply(self, rank: RolloutRank, msg: dict) -> None:
        failed = repr(rank.failed) if rank.failed is not None else None
        assert self._out is not None
        self._out.send({**msg, "rank": rank.rank_id, "failed": failed,
                        "stats": wire.stats_to_wire(rank.stats), "kv": rank.kv_stats()})

    def _handle(self, src: int, msg: dict) -> None:
        rank = self.ranks.get(msg.get("rank", -1))
        op = msg["op"]
        if rank is None:
            if op == "hello" and msg["rank"] in self._not_started:
                self._refuse(msg["rank"])
            elif op == "hello":  # a rank joining rollout here, still starting (`join`)
                self._hellos.add(msg["rank"])
            return
        if op == "hello":
            self._reply(rank, {"op": "hello"})
        elif op == "turn":
            self._turn(rank, msg)
        elif op == "pause":
            rank.pause(msg["task"], msg.get("keep", 0.0))
        elif op == "resume":
            rank.resume(msg["task"])
        elif op == "finish":
            rank.finish(msg["task"])
        elif op == "release":
            self._spawn(self._release(rank, msg))
        elif op in ("close", "drain"):
            self._spawn(self._close(rank, msg))

    def _turn(self, rank: RolloutRank, msg: dict) -> None:
        task = msg["task"]
        try:
            fut = rank.turn(task, msg["tokens"], wire.prefix_from_wire(msg["prefix"]),
                            sample_id=msg["sample_id"], temperature=msg["temperature"],
                            share_key=msg.get("share_key"),
                            max_action_tokens=msg.get("max_action_tokens"))
        except RankFailedError as e:
            self._reply(rank, {"op": "turn", "task": task, "error": str(e), "kind": "failed"})
            return
        except (RuntimeError, ValueError) as e:
            self._reply(rank, {"op": "turn", "task": task, "error": str(e), "kind": "error"})
            return

        def done(f: asyncio.Future) -> None:
            if f.cancelled():
                return
            e = f.exception()
            if e is not None:
                kind = "failed" if isinstance(e, RankFailedError) else "error"
                self._reply(rank, {"op": "turn", "task": task, "error": str(e), "kind": kind})
            else:
                self._reply(rank, {"op": "turn", "task": task,
                                   "result": wire.result_to_wire(f.result())})

        fut.add_done_callback(done)

    async def _release(self, rank: RolloutRank, msg: dict) -> None:
        h = await rank.release(msg["task"])
        self._reply(rank, {"op": "reply", "req": msg["req"], "handoff": wire.handoff_to_wire(h)})

    async def _close(self, rank: RolloutRank, msg: dict) -> None:
        # "drain" (a cell leaving rollout): the turns in flight finish first (their results
        # go out before this reply: one ordered stream); "close": the run is over.
        handed = await (rank.drain() if msg["op"] == "drain" else rank.close())
        self._reply(rank, {"op": "reply", "req": msg["req"],
                           "handoffs": {str(k): wire.handoff_to_wire(h)
                                        for k, h in handed.items()}})
        if self.ranks.get(rank.rank_id) is rank:
            # Its devices may join the trainer; a later rank on this cell is a new object.
            del self.ranks[rank.rank_id]
