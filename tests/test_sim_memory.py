"""Memory-derived costs of the simulator (tiderl/sim/memory.py): per-device bytes of each role
from the model shape and the sharding, and what a colocation that does not fit moves over
PCIe. JAX-free; the expected numbers are computed here by hand from the formulas' sources."""

import pytest

from tiderl.sim import memory
from tiderl.sim.costs import SimCostModel, load_profile, model_shape
from tiderl.sim.trainer import SimMicroBatch, SimTrainer


def _costs(profile="h100", model="qwen2.5-7b"):
    return SimCostModel(load_profile(profile), model_shape(model))


def test_trainer_bytes_follow_zero_and_the_model_shape():
    c = _costs()
    m = c.model
    tm = c.trainer_memory(8, 16384)
    # ZeRO §3.1: 2 + 2 + 12 bytes per parameter, sharded over the 8 data-parallel devices.
    assert tm.actor_state == pytest.approx(16 * 7.6155e9 / 8, rel=1e-3)
    assert tm.ref == pytest.approx(2 * m.params / 8)
    assert tm.gathered == 2 * m.layer_params * 2
    # Qwen2.5-7B: d 3584, 28 layers, 4 KV heads of 128, MLP 18944, vocab 152064 (bf16).
    per_tok = 28 * 3584 * 2 + 2 * (7 * 3584 + 2 * 512 + 3 * 18944) + 8 * 152064
    assert tm.activations == pytest.approx(per_tok * 16384)
    assert tm.runtime == 2e9 and tm.hbm == 80e9
    assert tm.colocated == pytest.approx(tm.actor_state + tm.ref + tm.gathered
                                         + tm.activations + tm.runtime)


def test_a_colocation_that_fits_pays_nothing_one_that_does_not_pays_its_bytes_over_pcie():
    c = _costs()
    # 7B on 8 H100s: ~46 GB together, fits: no swap.
    assert c.trainer_memory(8, 16384).colocation_excess == 0
    assert c.colocation_swap(8, 16384) == 0.0
    # 7B on 2 H100s with 8,192-token micro-batches: the Actor fits alone (~77 GB), not with
    # the Ref; the excess moves out and in (full duplex) at 55 GB/s.
    tm = c.trainer_memory(2, 8192)
    assert tm.actor_alone < 80e9 and tm.colocation_excess > 2e9
    assert c.colocation_swap(2, 8192) == pytest.approx(tm.colocation_excess / 55e9)
    # The same on an H200 (141 GB) fits.
    assert _costs("h200").colocation_swap(2, 8192) == 0.0
    # The Actor alone over HBM too (16k tokens on 2): at least the excess moves.
    tm16 = c.trainer_memory(2, 16384)
    assert tm16.actor_alone > 80e9
    assert c.colocation_swap(2, 16384) == pytest.approx(tm16.colocation_excess / 55e9)


def test_h200_profile_is_the_h100_with_hbm3e():
    h100, h200 = load_profile("h100"), load_profile("h200")
    assert h200.device.hbm_bytes == 141e9 and h200.device.hbm_bw == 4.8e12
    assert h200.device.flops == h100.device.flops
    assert h200.device.pcie_bw == h100.device.pcie_bw == 55e9
    # More HBM, a bigger KV pool; more bandwidth, a faster decode.
    c1, c2 = _costs("h100"), _costs("h200")
    assert c2.kv_capacity_tokens() > 2 * c1.kv_capacity_tokens()
    assert c2.decode(batch=64, context_sum=64 * 2000) < c1.decode(batch=64,
                                                                  context_sum=64 * 2000)


def test_hybrid_engine_switch_moves_the_engine_weights_and_what_does_not_fit():
    c = _costs()
    m = c.model
    sw = c.hybrid_switch(32, 1, 16384)
    # 7B over 32 devices: the training state (4.3 GB) stays beside vLLM's 72 GB reservation;
    # the engine's 15.2 GB of bf16 weights go to host memory, the KV pool is freed.
    assert sw["bytes_train_state_resident"] == 1.0
    assert sw["to_train"] == pytest.approx(m.weight_bytes / 55e9)
    assert sw["to_rollout"] == 0.0
    # On 4 devices the state (38 GB) does not fit beside the engine: it moves both ways.
    sw4 = c.hybrid_switch(4, 1, 16384)
    state = 18 * m.params / 4
    assert sw4["bytes_train_state_resident"] == 0.0
    assert sw4["to_train"] == pytest.approx((m.weight_bytes + state) / 55e9)
    assert sw4["to_rollout"] == pytest.approx(state / 55e9)
    # The weight update gathers the full weights from the shards over the slowest link.
    assert c.reshard(32) == pytest.approx(0.1 + m.weight_bytes * 31 / 32 / 45e9)


def _step(trainer, mbs):
    from tiderl.sim.clock import run_virtual

    async def go():
        for mb in mbs:
            trainer.submit(mb)
        out = await trainer.finish_step_async()
        trainer.close()
        return out

    return run_virtual(go())


def test_sim_trainer_offload_auto_swaps_only_when_it_does_not_fit():
    c = _costs()
    mb = SimMicroBatch(ranks=((4096,), (4096,)), n_action_tokens=10, n_seqs=2)
    # Fits (8 devices): vanilla streaming alternates for free.
    fit = _step(SimTrainer(c, actor_gpus=8, aggregate=False, offload="auto"), [mb] * 4)
    assert fit["alternations"] == 8 and fit["swaps"] == 0 and fit["time_swap"] == 0.0
    # Does not fit (2 devices): every alternation moves the excess.
    tight = _step(SimTrainer(c, actor_gpus=2, aggregate=False, offload="auto",
                             tokens_per_gpu=8192), [mb] * 4)
    assert tight["swaps"] == tight["alternations"] == 8
    assert tight["time_swap"] == pytest.approx(8 * c.colocation_swap(2, 8192))
    with pytest.raises(ValueError, match="offload"):
        SimTrainer(c, actor_gpus=2, offload="sometimes")


def test_sync_pays_the_hybrid_switch_every_step():
    c = _costs()
    mb = SimMicroBatch(ranks=((4096,),) * 4, n_action_tokens=10, n_seqs=4)
    out = _step(SimTrainer(c, actor_gpus=32, colocated_rollout=True), [mb] * 2)
    sw = c.hybrid_switch(32, 1, 16384)
    assert out["time_switch"] == pytest.approx(sw["to_train"] + sw["to_rollout"])
    assert out["swaps"] == 2


def test_memory_module_numbers_by_hand():
    m = model_shape("qwen3-4b")
    assert memory.layer_working_bytes_per_token(m) == 2 * (7 * 2560 + 2 * 1024 + 3 * 9728)
    assert memory.swap_seconds(55e9, 55e9) == 1.0 and memory.swap_seconds(0, 55e9) == 0.0
