"""A follower's rollout ranks seen from process 0: `RemoteRank` ↔ `HostAgent` over a real
coordination service (JAX's distributed runtime, two clients in this one process: process 0
and process 1 of a two-process world, without a JAX world of their own), with a real engine.

What elastic scaling across processes needs from them: a drained remote rank finishes the turn
in flight (its result arrives first) and hands back the tasks it held; a rank joining on the
agent answers the controller's hello once started (also when the hello came first); one whose
start fails answers it as failed, and the run goes on."""

import asyncio
import threading

import jax
import pytest
from jax._src.lib import _jax

from tiderl.models.config import ModelConfig
from tiderl.models.policy import init_policy
from tiderl.runtime.remote_rank import HostAgent, RemoteRank, Router
from tiderl.runtime.world import World, free_port
from tiderl.serving.config import RolloutConfig
from tiderl.serving.engine import Engine
from tiderl.serving.rank import RolloutRank

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_dim=64, max_seq_len=128)
ROLLOUT = RolloutConfig(num_pages=8, page_size=16, max_slots=4, max_context=32,
                        max_action_tokens=4, decode_buckets=(4,), prefill_buckets=(16,))


@pytest.fixture(scope="module")
def worlds():
    addr = f"127.0.0.1:{free_port()}"
    service = _jax.get_distributed_runtime_service(addr, 2)
    clients = [_jax.get_distributed_runtime_client(addr, i) for i in range(2)]
    joins = [threading.Thread(target=c.connect) for c in clients]
    for t in joins:
        t.start()
    for t in joins:
        t.join(60)
    yield [World(i, 2, client=c) for i, c in enumerate(clients)]
    stops = [threading.Thread(target=c.shutdown) for c in clients]
    for t in stops:
        t.start()
    for t in stops:
        t.join(30)
    service.shutdown()


def test_drain_join_and_failed_start_across_the_rank_stream(worlds):
    graphdef, params = init_policy(TINY, seed=0)
    dev = jax.devices()[1]

    def make(rid, tree, version):
        if tree is None:
            raise RuntimeError("no weights for this rank")
        eng = Engine(graphdef, jax.device_put(tree, dev), TINY, ROLLOUT, version=version)
        return RolloutRank(rid, eng)

    async def scenario():
        leader, follower = worlds
        agent = HostAgent(follower, [make(5, params, 0)], make_rank=make)
        serving = asyncio.ensure_future(agent.serve())
        router = Router(leader)
        remote = RemoteRank(5, 1, router)
        await asyncio.wait_for(remote.start(), 60)
        # Task 1 finishes a turn and stays held there; task 2's turn is in flight at the drain.
        first = await asyncio.wait_for(remote.turn(1, [3, 4, 5, 6], sample_id=11), 60)
        assert 1 <= len(first.action_tokens) <= ROLLOUT.max_action_tokens
        in_flight = remote.turn(2, [7, 8, 9], sample_id=12)
        handed = await asyncio.wait_for(remote.drain(), 60)
        assert in_flight.done() and not in_flight.cancelled()  # its result came first
        assert len(in_flight.result().action_tokens) >= 1
        assert set(handed) == {1, 2} and all(h.prefix is not None for h in handed.values())
        assert not remote.live and 5 not in agent.ranks  # the agent let the rank go
        # Joining: the controller greets ranks 6 and 7 before the agent starts them (the
        # control thread's `join` after a remesh unit); 7 cannot start.
        joined, broken = RemoteRank(6, 1, router), RemoteRank(7, 1, router)
        starts = [asyncio.ensure_future(r.start()) for r in (joined, broken)]
        await asyncio.sleep(0.5)
        assert not any(s.done() for s in starts)
        await asyncio.to_thread(agent.join, {6: params, 7: None}, 3)
        await asyncio.wait_for(asyncio.gather(*starts), 60)
        assert joined.live and joined.failed is None
        assert broken.failed is not None and "no weights" in str(broken.failed)
        again = await asyncio.wait_for(joined.turn(3, [3, 4, 5, 6], sample_id=11), 60)
        assert again.action_tokens == first.action_tokens  # same weights, same sample id
        assert set(again.versions) == {3}
        await asyncio.wait_for(joined.close(), 60)
        agent.stop()
        await asyncio.wait_for(serving, 60)
        router.close()

    asyncio.run(scenario())
