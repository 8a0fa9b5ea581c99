"""Figure 14 on the simulator (`python -m tiderl.sim.experiments fig14`): the trainer's Ref/Actor
schedules alone, without a job. No JAX.

Eight micro-batches of 8,192 tokens ready at once on 4 GPUs (data parallel) under VS, VSO, CM,
CMO and DM (`SimTrainer` on the virtual clock), their overhead over the Actor's own compute,
the memory that decides whether an alternation moves bytes, and what CM could save where Ref
and Actor do not fit one device together (`_fig14_unfit`).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from collections.abc import Callable
from typing import Any

from tiderl.sim.cluster import SimConfig, build_costs, ratio
from tiderl.sim.jobs import pyplot, say, table
from tiderl.sim.trainer import SimMicroBatch, SimTrainer


def fig14(args: argparse.Namespace) -> dict[str, Any]:
    """Eight micro-batches of 8,192 tokens ready at once on 4 GPUs (data parallel)."""
    cfg = SimConfig(model=args.model)
    costs = build_costs(cfg)
    gpus, n_mb, seq = 4, 8, 2048
    mb = SimMicroBatch(ranks=tuple((seq,) for _ in range(gpus)), n_action_tokens=0, n_seqs=gpus)
    mb_dm = SimMicroBatch(ranks=tuple(((seq * gpus) // (gpus - 1),) for _ in range(gpus - 1)),
                          n_action_tokens=0, n_seqs=gpus)
    setups: dict[str, Callable[[], tuple[SimTrainer, SimMicroBatch]]] = {
        "VS": lambda: (SimTrainer(costs, actor_gpus=gpus, aggregate=False, offload=False), mb),
        "VSO": lambda: (SimTrainer(costs, actor_gpus=gpus, aggregate=False, offload=True), mb),
        # CM offloads only what does not fit (tiderl's trainer; `SimConfig.offload="auto"`).
        "CM": lambda: (SimTrainer(costs, actor_gpus=gpus, aggregate=True, offload="auto",
                                  tokens_per_gpu=seq), mb),
        "CMO": lambda: (SimTrainer(costs, actor_gpus=gpus, aggregate=True, offload=True), mb),
        "DM": lambda: (SimTrainer(costs, actor_gpus=gpus - 1, ref_gpus=1), mb_dm),
    }
    # The Actor's own work on all four GPUs: what no schedule can avoid.
    ideal = n_mb * (costs.actor_forward(mb.ranks) + costs.actor_backward(mb.ranks))

    async def one(make: Callable[[], tuple[SimTrainer, SimMicroBatch]]) -> dict:
        tr, m = make()
        t0 = asyncio.get_running_loop().time()
        for _ in range(n_mb):
            tr.submit(m)
        res = await tr.finish_step_async()
        res["elapsed"] = asyncio.get_running_loop().time() - t0
        tr.close()
        return res

    from tiderl.sim.clock import run_virtual

    res = {k: run_virtual(one(f)) for k, f in setups.items()}
    over = {k: v["elapsed"] - ideal for k, v in res.items()}
    rows = [(k, v["elapsed"], over[k], ratio(over[k], over["VS"]), v["swaps"],
             v["alternations"], v["time_ref"], v["time_swap"]) for k, v in res.items()]
    say(f"\nFigure 14 ({args.model}, 8 ready micro-batches × 8,192 tokens, 4×H100, DP; DM: "
        "3 Actor + 1 Ref GPU)")
    table(rows, ("mode", "step s", "overhead s", "overhead/VS", "swaps", "alternations",
                 "ref s", "swap s"))
    say(f"overhead = step time − the Actor's own forward+backward on 4 GPUs ({ideal:.2f} s). "
        "paper: RA2P (CM, DM) cuts overhead by up to 44.3% vs VS/VSO (goal: ≤ 0.56× VS)")
    tm = costs.trainer_memory(gpus, seq)
    say(f"memory per GPU (tiderl.sim.memory): Actor state {tm.actor_state / 1e9:.1f} GB "
        f"(16 B/param over {gpus}) + Ref {tm.ref / 1e9:.1f} + gathered layers "
        f"{tm.gathered / 1e9:.1f} + activations {tm.activations / 1e9:.1f} + runtime "
        f"{tm.runtime / 1e9:.1f} = {tm.colocated / 1e9:.1f} GB of {tm.hbm / 1e9:.0f}: " +
        ("both fit, so VS alternates without moving bytes" if not tm.colocation_excess else
         f"over by {tm.colocation_excess / 1e9:.1f} GB, moved at each alternation"))
    say("CM offloads what does not fit (here nothing); CMO always offloads, against VSO")
    say("ours: without offload a Ref/Actor alternation has no roofline cost "
        "(context_switch_c0 = 0 in the h100 profile), so VS pays only for the Ref's compute; "
        "what RA2P saves here is the swaps (VSO) and, in DM, moving the Ref off the Actor")
    unfit = _fig14_unfit(costs, gpus, n_mb, over["VS"], tm, one)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(list(res), [ideal] * len(res), label="Actor compute")
    ax.bar(list(res), list(over.values()), bottom=[ideal] * len(res), label="overhead")
    ax.set_ylabel("seconds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "fig14.png", dpi=120)
    return {"cm_over_vs": ratio(over["CM"], over["VS"]), "dm_over_vs": ratio(over["DM"],
                                                                            over["VS"]),
            "cm_over_vso": ratio(over["CM"], over["VSO"]),
            "cmo_over_vso": ratio(over["CMO"], over["VSO"]),
            "step_s": {k: v["elapsed"] for k, v in res.items()}, **unfit}


def _fig14_unfit(costs: Any, gpus: int, n_mb: int, r_vs: float, tm0: Any,
                 one: Callable[[Callable[[], tuple[SimTrainer, SimMicroBatch]]], Any]
                 ) -> dict[str, Any]:
    """What CM could save against VS: its only lever is the alternations (VS: two per
    micro-batch, CM: two per aggregate), the rest of both overheads (VS's, `r_vs`, when it
    swaps nothing) being the Ref's compute. So a cut of 44.3% needs each alternation to cost
    at least t* = 0.443 r_vs / (0.557 · 2 n_mb − 2). An alternation costs bytes over PCIe
    only where Ref and Actor do not fit one device together (`tm0`: the memory of the run
    above): Qwen2.5-14B at 8,192 tokens per GPU (the paper's micro-batch read per GPU)
    shows that case."""
    from tiderl.sim.clock import run_virtual

    t_star = 0.443 * r_vs / (0.557 * 2 * n_mb - 2)
    pcie = costs.profile.device.pcie_bw if costs.profile.device else math.nan
    seq, model = 8192, "qwen2.5-14b"
    costs = build_costs(SimConfig(model=model))
    mb = SimMicroBatch(ranks=tuple((seq,) for _ in range(gpus)), n_action_tokens=0, n_seqs=gpus)
    ideal = n_mb * (costs.actor_forward(mb.ranks) + costs.actor_backward(mb.ranks))
    res = {k: run_virtual(one(lambda agg=agg: (SimTrainer(
        costs, actor_gpus=gpus, aggregate=agg, offload="auto", tokens_per_gpu=seq), mb)))
        for k, agg in (("VS", False), ("CM", True))}
    over = {k: v["elapsed"] - ideal for k, v in res.items()}
    tm = costs.trainer_memory(gpus, seq)
    say(f"a 44.3% cut against VS needs every alternation to cost t* = {t_star * 1e3:.0f} ms "
        f"({t_star * pcie / 1e9:.1f} GB over PCIe at {pcie / 1e9:.0f} GB/s); with "
        f"{(tm0.hbm - tm0.colocated) / 1e9:.1f} GB free beside both models above, none "
        "moves: VS leaves nothing for CM to win")
    say(f"{model} at 8,192 tokens per GPU: {tm.colocated / 1e9:.1f} GB of {tm.hbm / 1e9:.0f} "
        f"(over by {tm.colocation_excess / 1e9:.1f} GB): VS swaps {res['VS']['swaps']} times "
        f"({res['VS']['time_swap']:.2f} s), CM {res['CM']['swaps']} "
        f"({res['CM']['time_swap']:.2f} s): CM/VS overhead "
        f"{ratio(over['CM'], over['VS']):.2f}")
    return {"alternation_cost_needed_s": t_star,
            "cm_over_vs_14b_8192_per_gpu": ratio(over["CM"], over["VS"]),
            "colocation_excess_gb_14b_8192_per_gpu": tm.colocation_excess / 1e9}

