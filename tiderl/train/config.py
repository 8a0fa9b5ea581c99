"""Trainer config: devices, optimizer, GRPO loss, micro-batching, RA2P (JAX-free).

Checkpoint cadence and retention are the controller's (`controller.checkpoint_every`,
`controller.keep_checkpoints`); the batch range is `controller.groups_per_step` /
`controller.min_groups_per_step`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from tiderl.configlib import ConfigError

KL_LOSSES = ("k3_reverse", "k2", "k3_forward")
"""trainer.kl_loss's values (grpo.py `kl_loss_term`); k1 is a metric only (its gradient is 0)."""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""trainer.lora_targets' names (PEFT's), each a projection of the built-in decoder
(models/lora.py `TARGETS`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Actor/Ref placement and the optimisation of the policy."""

    actor_devices: int = 1
    ref_devices: int = 0
    """Devices for a decoupled Ref; 0 colocates Ref with the Actor."""
    fsdp: int = 1
    """FSDP axis of the actor mesh (data axis = actor_devices / (fsdp × model_parallel))."""
    model_parallel: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Clip by global norm (after normalising the accumulated gradient); 0 disables."""
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: hold lr, or cosine-decay it to 0 over `decay_steps`."""
    decay_steps: int = 1000
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    vision_lr_scale: float = 1.0
    """A vision-language policy's tower learns at lr × this (with model.train_vision). Adam
    moves every weight by about the learning rate, and the patch embedding sums C·tp·p² inputs
    (1,536 for 16-pixel patches), so at the decoder's rate a tower trained from scratch turns
    every patch's feature the same way within a few updates; 1e-3 kept them apart."""

    # --- GRPO loss (train/grpo.py) ---
    adv_eps: float = 1e-6
    """Advantage = (r − mean) / (std + adv_eps) within a group."""
    zero_var_groups: Literal["drop", "keep"] = "drop"
    """Groups whose rewards are all equal: drop them, or keep them with zero advantage."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    """Ratio clipped to [1 − clip_low, 1 + clip_high] (clip_high > clip_low is 'clip-higher')."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; 0 disables."""
    is_cap: float = 2.0
    """With stale_loss='is', stale tokens (version < trainer version) get truncated IS weights
    min(ratio, is_cap)."""
    stale_loss: Literal["is", "clip"] = "clip"
    """Stale tokens' loss: 'clip' (the PPO clip against their behaviour logprobs, as fresh
    tokens; is_cap unused) or 'is' (truncated IS weights min(ratio, is_cap), no clip: in the
    asynchronous loop it let the policy's entropy blow up in 4 of 5 runs of the default task)."""
    kl_coef: float = 0.001
    entropy_coef: float = 0.0
    """Entropy bonus −c·H_t, H_t the exact entropy of the full next-token distribution at each
    action token (verl's entropy_coeff); 0.03–0.1 keeps a policy trained from scratch exploring
    once most GRPO groups stop varying."""
    entropy_max: float = 0.0
    """Cap (nats) of the entropy bonus per token, −c·min(H_t, entropy_max): the bonus stops
    pushing where the distribution is already that spread, so it cannot run away (0: no cap).
    E.g. a little above ln(k) keeps k answers in play without pushing mass onto the rest."""
    kl_loss: Literal["k3_reverse", "k2", "k3_forward"] = "k3_reverse"
    """The KL term of the loss (×kl_coef), named by what its gradient optimises (grpo.py
    `kl_loss_term`): 'k3_reverse' (k3's value, k2's gradient: reverse KL(π‖π_ref); verl's
    'k3+'), 'k2' (reverse KL, k2's value) or 'k3_forward' (naive k3, whose gradient is the
    forward KL(π_ref‖π): verl's low_var_kl). k1 is rejected: its expected gradient is 0."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of KL(π‖π_ref) logged as the `kl` metric (a value only; the loss is
    trainer.kl_loss's)."""
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """token_mean: sum over action tokens / action tokens in the step; seq_mean: per-sequence
    token mean, averaged over the step's sequences."""

    # --- step-level credit (train/advantages.py) ---
    advantage: Literal["grpo", "gigpo"] = "grpo"
    """grpo: one group-normalised advantage per episode. gigpo (arXiv 2505.10978): plus, on
    each turn whose anchor recurs among its group's siblings, `gigpo_omega ×` a step advantage
    from the discounted returns of that anchor's turns (multi-turn tasks)."""
    gigpo_omega: float = 1.0
    """Weight of the step advantage: A = A_episode + omega · A_step (the paper's 1)."""
    gigpo_gamma: float = 0.95
    """Discount of the return from a turn: gamma^(turns after it) × the episode's reward."""
    gigpo_anchor: Literal["history", "observation"] = "history"
    """What makes two turns one step group: 'history', the same whole context before the action
    (the same policy input); 'observation', the same tokens since the previous action (the
    current observation, as the paper's code keys anchor states; pooled over turns)."""
    gigpo_step_norm: Literal["std", "mean"] = "std"
    """Step advantage (R − mean) / (std + adv_eps), like the episode one, or R − mean."""

    # --- memory (train/head.py, models/decoder.py) ---
    head_chunk: int = 0
    """Tokens per chunk of the vocab head in training (logprobs/entropies from hidden states,
    logits recomputed per chunk in the backward): no B×T×V fp32 array is kept. 0 applies the
    head to the whole micro-batch at once. E.g. 512–2048 for a 150k vocabulary. Policies
    without `hidden_states`/`head_vd` (custom ones) always take the whole-batch path."""
    remat: bool = False
    """Recompute each decoder block in the backward (`nnx.remat`): only block inputs are kept
    between the Actor forward and backward. Needs a policy with `hidden_states` (built-in).
    With model.scan_layers the backward recomputes one block at a time."""
    remat_group: int = 1
    """With trainer.remat and model.scan_layers: keep only every that-many-th block input
    between forward and backward; the backward recomputes each group's other inputs (one more
    forward of the blocks, about a quarter more step compute) for n_layers/group + group
    saved inputs instead of n_layers (e.g. 6 for 24 layers: 10 instead of 24). Must divide
    model.n_layers. 1 keeps every block's input. Exact: the same per-block arithmetic."""
    token_chunk: int = 0
    """Positions per chunk of each decoder block in training (built-in decoder): attention
    takes that many queries at a time (`layers.attend_query_chunked`) and the MLP that many
    positions of every row, each chunk recomputed in the backward, so no T×T scores per head
    and no T×mlp_dim intermediates are live beyond one chunk. 0 runs whole rows. E.g.
    128–256 for 1k–4k token rows. Exact: the same per-token arithmetic."""

    # --- micro-batches (train/dispatch.py) ---
    row_len: int = 1024
    """Tokens per packed row; a trajectory longer than this cannot be trained."""
    rows_per_rank: int = 4
    """Rows each data-parallel rank takes per micro-batch (the per-rank token budget is
    rows_per_rank × row_len); smaller micro-batches are padded to power-of-two row buckets."""
    balance: Literal["lpt", "zigzag"] = "lpt"

    # --- RA2P executor (train/ra2p.py, train/backend.py, train/executor.py) ---
    mode: Literal["auto", "decoupled", "colocated"] = "auto"
    """auto: decoupled when ref_devices > 0, else colocated; the cost model advises switches.
    colocated needs ref_devices = 0 (the Ref shares the Actor's devices)."""
    aggregate: bool = True
    """Colocated: run Ref over all ready micro-batches, then Actor over them (False alternates
    per micro-batch, the vanilla-streaming baseline)."""
    max_aggregate: int = 16
    """Most micro-batches one colocated Ref/Actor phase takes (memory cap of the cost model)."""
    offload: Literal["never", "always", "auto"] = "auto"
    """Colocated: keep the idle model's state in host memory (pinned_host) between phases.
    auto: only when the Actor state plus the Ref params would fill more than
    `offload_fraction` of a device's memory (never on CPU, which reports no limit)."""
    offload_fraction: float = 0.5
    colocate_slack: float = 0.1
    """RA2P picks colocated when C_col ≤ (1 + slack)·C_dec: it frees the Ref devices."""
    sync_timings: bool = False
    """Block after every phase so per-phase times are exact (serialises the decoupled pipeline)."""

    # --- LoRA (models/lora.py) ---
    lora_rank: int = 0
    """Rank of LoRA adapters on the built-in decoder's `lora_targets` (0: full fine-tuning).
    Only the adapters get gradients and optimizer moments; the base is frozen and is also the
    Ref (no copy of it when colocated); engines serve merged weights and a weight sync moves
    the adapters alone (`sync_bytes` in metrics.jsonl)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (lora_alpha / lora_rank)·A·B (PEFT's lora_alpha)."""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """Projections that get adapters, by PEFT's names: q_proj, k_proj, v_proj, o_proj
    (attention), gate_proj, up_proj, down_proj (MLP). Default: all of them."""

    def _check_lora(self) -> None:
        if self.lora_rank < 0:
            raise ConfigError(f"config key 'trainer.lora_rank'={self.lora_rank} must be >= 0 "
                              "(0: full fine-tuning; e.g. 8-64 for LoRA)")
        if self.lora_rank and self.lora_alpha <= 0:
            raise ConfigError(f"config key 'trainer.lora_alpha'={self.lora_alpha} must be "
                              "positive (e.g. 2 × trainer.lora_rank)")
        known = LORA_TARGETS
        if self.lora_rank and not self.lora_targets:
            raise ConfigError("config key 'trainer.lora_targets' is empty; name some of "
                              f"{', '.join(known)} (or set trainer.lora_rank=0)")
        for t in self.lora_targets:
            if t not in known:
                raise ConfigError(f"config key 'trainer.lora_targets' names {t!r}, which "
                                  f"matches no module of the built-in decoder; use some of "
                                  f"{', '.join(known)}")
        if len(set(self.lora_targets)) != len(self.lora_targets):
            raise ConfigError(f"config key 'trainer.lora_targets'={list(self.lora_targets)} "
                              "names a module twice; list each once")

    def __post_init__(self):
        self._check_lora()
        if self.actor_devices <= 0:
            raise ConfigError("config key 'trainer.actor_devices' must be positive")
        if self.ref_devices < 0:
            raise ConfigError("config key 'trainer.ref_devices' must be >= 0 (0 colocates)")
        if self.actor_devices % (self.fsdp * self.model_parallel):
            raise ConfigError(
                f"config key 'trainer.fsdp'={self.fsdp} × trainer.model_parallel="
                f"{self.model_parallel} must divide trainer.actor_devices={self.actor_devices}; "
                "change one of them"
            )
        for name in ("lr", "vision_lr_scale"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config key 'trainer.{name}' must be positive, got "
                                  f"{getattr(self, name)}")
        for name in ("weight_decay", "grad_clip", "warmup_steps", "adv_eps", "kl_coef",
                     "entropy_coef", "entropy_max", "colocate_slack"):
            if getattr(self, name) < 0:
                raise ConfigError(f"config key 'trainer.{name}' must be >= 0, got "
                                  f"{getattr(self, name)}")
        for name in ("head_chunk", "token_chunk"):
            if getattr(self, name) < 0:
                raise ConfigError(f"config key 'trainer.{name}' must be >= 0 (0: unchunked), "
                                  f"got {getattr(self, name)}")
        for name in ("decay_steps", "row_len", "rows_per_rank", "max_aggregate", "remat_group"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config key 'trainer.{name}' must be positive, got "
                                  f"{getattr(self, name)}")
        if not (0 <= self.clip_low < 1) or self.clip_high < 0:
            raise ConfigError(
                f"config keys 'trainer.clip_low'={self.clip_low} / 'trainer.clip_high'="
                f"{self.clip_high}: need 0 <= clip_low < 1 and clip_high >= 0 (e.g. 0.2, 0.28)"
            )
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"config key 'trainer.dual_clip'={self.dual_clip} must be > 1 "
                              "(typically 3) or 0 to disable")
        if self.kl_loss == "k1":
            raise ConfigError("config key 'trainer.kl_loss'='k1' has zero expected gradient (it "
                              "regularises nothing); use 'k3_reverse' or 'k2' (k1 stays "
                              "available as the logged metric, trainer.kl_estimator)")
        if self.kl_loss not in KL_LOSSES:
            raise ConfigError(f"config key 'trainer.kl_loss'={self.kl_loss!r} must be one of "
                              f"{', '.join(KL_LOSSES)}")
        if self.stale_loss not in ("is", "clip"):
            raise ConfigError(f"config key 'trainer.stale_loss'={self.stale_loss!r} must be "
                              "'is' (truncated importance weights) or 'clip' (PPO clip)")
        self._check_credit()
        if self.is_cap <= 0:
            raise ConfigError(f"config key 'trainer.is_cap'={self.is_cap} must be positive "
                              "(1.0 is V-trace truncation)")
        if self.mode == "decoupled" and self.ref_devices == 0:
            raise ConfigError("config key 'trainer.mode'='decoupled' needs trainer.ref_devices "
                              "> 0 (devices for the Ref); set it or use mode 'colocated'")
        if self.mode == "colocated" and self.ref_devices > 0:
            raise ConfigError(
                f"config key 'trainer.mode'='colocated' runs the Ref on the Actor's devices, but "
                f"trainer.ref_devices={self.ref_devices}; set trainer.ref_devices=0 or use mode "
                "'decoupled' (or 'auto')")
        if not 0 < self.offload_fraction <= 1:
            raise ConfigError(f"config key 'trainer.offload_fraction'={self.offload_fraction} "
                              "must lie in (0, 1]")
        if not 0 < self.adam_b1 < 1 or not 0 < self.adam_b2 < 1:
            raise ConfigError("config keys 'trainer.adam_b1'/'trainer.adam_b2' must lie in "
                              "(0, 1)")

    def _check_credit(self) -> None:
        for name, allowed in (("advantage", ("grpo", "gigpo")),
                              ("gigpo_anchor", ("history", "observation")),
                              ("gigpo_step_norm", ("std", "mean"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"config key 'trainer.{name}'={getattr(self, name)!r} must be "
                                  f"one of {', '.join(allowed)}")
        if not 0 < self.gigpo_gamma <= 1:
            raise ConfigError(f"config key 'trainer.gigpo_gamma'={self.gigpo_gamma} must lie in "
                              "(0, 1] (the paper uses 0.95)")
        if not self.gigpo_omega >= 0:
            raise ConfigError(f"config key 'trainer.gigpo_omega'={self.gigpo_omega} must be >= 0 "
                              "(the paper uses 1)")
