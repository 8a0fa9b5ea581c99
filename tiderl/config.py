"""The run config: component configs composed into one tree, YAML presets, dotted overrides.

No JAX here: launch validates everything (device plan included, given a device count) before
any work starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiderl.configlib import (
    ConfigError,
    apply_overrides,
    dump_yaml,
    from_dict,
    load_yaml,
    merge,
    to_dict,
)
from tiderl.control.config import ControllerConfig
from tiderl.envs.config import DEFAULT_MAX_ACTION_CHARS, EnvConfig
from tiderl.models.config import ModelConfig
from tiderl.models.tokenizer import max_token_chars
from tiderl.runtime.devices import ClusterConfig, DevicePlan, cell_size_for, plan_devices
from tiderl.runtime.world import DistributedConfig
from tiderl.serving.config import RolloutConfig
from tiderl.train.config import TrainerConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
VISION_PROCESSES = (
    "config key 'model.vision' on {n} processes: images do not cross processes yet (neither to "
    "rollout ranks on other hosts nor into the multi-process trainer); run a vision-language "
    "policy in one process (distributed.coordinator='')")


# The embedded default: the default task (guess 1..8 in three guesses) learned from scratch by
# a ~90k-parameter decoder on a 2-core CPU. Component defaults stay generic; these are the
# run-level choices that make that job learn within minutes.
def _default_env() -> EnvConfig:
    # 4 turns: the task's 3 guesses end every episode first.
    return EnvConfig(options=("format_bonus=0.1", "hint=range", "targets=member"), group_size=8,
                     max_turns=4)


def _default_rollout() -> RolloutConfig:
    return RolloutConfig(max_action_tokens=1, max_context=128, num_pages=512, page_size=16,
                         max_slots=64, decode_buckets=(8, 16, 32, 64), prefill_buckets=(16, 64))


def _default_trainer() -> TrainerConfig:
    # Exact entropy bonus 0.03 keeps siblings exploring past the "copy the range's lower bound"
    # plateau (5/8); the cosine decay over the 700 steps stops the late collapses a constant
    # 3e-3 showed once the policy is nearly deterministic.
    # The bonus is capped at 2.3 nats (a little above ln 8, the eight answers): uncapped, once
    # the rollout ran further ahead of the trainer it pushed mass onto non-answers and the
    # entropy ran away (2.2 → 5.5 nats in three updates) until every group scored alike.
    return TrainerConfig(lr=3e-3, lr_schedule="cosine", decay_steps=700, kl_coef=0.0,
                         entropy_coef=0.03, entropy_max=2.3, row_len=128, rows_per_rank=8)


def _default_controller() -> ControllerConfig:
    # Whichever comes first: 700 steps (the end of the lr decay) or 8 minutes, so the whole run
    # (compilation and the final evaluation included) stays within 10 minutes on a 2-core CPU.
    # 16 groups × 8 tasks per update: 64 episodes per update proved too noisy for the greedy
    # evaluation to settle; 128 did.
    return ControllerConfig(steps=700, time_limit_s=480.0, eval_every=50, checkpoint_every=100,
                            groups_per_step=16, groups_per_microbatch=4)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one `python -m tiderl.launch` run needs."""

    seed: int = 0
    run_dir: str = "runs/default"
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=_default_rollout)
    trainer: TrainerConfig = dataclasses.field(default_factory=_default_trainer)
    env: EnvConfig = dataclasses.field(default_factory=_default_env)
    controller: ControllerConfig = dataclasses.field(default_factory=_default_controller)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def __post_init__(self):
        if self.rollout.max_context > self.model.max_seq_len:
            raise ConfigError(
                f"config key 'rollout.max_context'={self.rollout.max_context} exceeds "
                f"model.max_seq_len={self.model.max_seq_len}; lower rollout.max_context or "
                "raise model.max_seq_len"
            )
        pages_needed = -(-self.rollout.max_context // self.rollout.page_size)
        if pages_needed > self.rollout.num_pages:
            raise ConfigError(
                f"config key 'rollout.num_pages'={self.rollout.num_pages} cannot hold one "
                f"{self.rollout.max_context}-token context ({pages_needed} pages of "
                f"{self.rollout.page_size}); raise rollout.num_pages or lower rollout.max_context"
            )
        r = self.rollout
        if self.model.n_heads % r.devices_per_rank:
            raise ConfigError(
                f"config key 'rollout.devices_per_rank'={r.devices_per_rank} does not divide "
                f"model.n_heads={self.model.n_heads}: a tensor-parallel rank shards attention "
                "heads over its devices; use a divisor of model.n_heads")
        if r.max_context > self.trainer.row_len:
            raise ConfigError(
                f"config key 'rollout.max_context'={r.max_context} exceeds trainer.row_len="
                f"{self.trainer.row_len} (a trajectory is trained in one packed row, so a longer "
                "one could not be trained); lower rollout.max_context or raise trainer.row_len")
        if r.top_k or r.top_p < 1.0:
            key, value, off = (("top_k", r.top_k, "0") if r.top_k else ("top_p", r.top_p, "1.0"))
            raise ConfigError(
                f"config key 'rollout.{key}'={value}: truncated sampling in a training run biases "
                "the GRPO importance ratios (behaviour logprobs are full-vocabulary); set "
                f"rollout.{key}={off} (top-k/top-p stay available on the Engine for evaluation)")
        if self.trainer.lora_rank and self.model.policy != "decoder":
            raise ConfigError(
                f"config key 'trainer.lora_rank'={self.trainer.lora_rank} needs the built-in "
                f"decoder, not model.policy={self.model.policy!r}; set trainer.lora_rank=0")
        self.ers_enabled()  # controller.ers=on with roles that cannot move: fail now
        self._fit_action_chars()
        if self.controller.system_prompt and self.model.tokenizer == "byte":
            raise ConfigError(
                "config key 'controller.system_prompt' is set, but the byte tokenizer's turn "
                "template has no system role; set controller.system_prompt='' or use a "
                "model.tokenizer whose template has one (ChatML, Llama 3)")
        if self.trainer.vision_lr_scale != 1.0 and (
                self.model.vision is None or not self.model.train_vision or self.trainer.lora_rank):
            raise ConfigError(
                f"config key 'trainer.vision_lr_scale'={self.trainer.vision_lr_scale} scales a "
                "trained vision tower's learning rate, and this run trains none (model.vision "
                "unset, model.train_vision=false, or LoRA, which adapts the language model "
                "only); remove it")
        if self.model.vision is not None and self.distributed.num_processes > 1:
            raise ConfigError(VISION_PROCESSES.format(n=self.distributed.num_processes))

    def _fit_action_chars(self) -> None:
        """env.max_action_chars against rollout.max_action_tokens: derived when 0 (at least
        4096), else it must hold a whole action for the in-process server. Each token decodes
        to at most `max_token_chars` characters (1 for the byte tokenizer)."""
        env, r = self.env, self.rollout
        per = max_token_chars(self.model.tokenizer)
        if per is None:  # unreadable tokenizer: launch's check names it
            per = 1
        need = r.max_action_tokens * per
        if env.max_action_chars == 0:
            object.__setattr__(self, "env", dataclasses.replace(
                env, max_action_chars=max(DEFAULT_MAX_ACTION_CHARS, need)))
        elif env.max_action_chars < need and not env.url and env.kind == "env":
            raise ConfigError(
                f"config key 'env.max_action_chars'={env.max_action_chars} cannot hold "
                f"rollout.max_action_tokens={r.max_action_tokens} tokens of model.tokenizer="
                f"{self.model.tokenizer!r} (up to {per} character{'s' * (per != 1)} each, "
                f"{need} in all); set "
                f"env.max_action_chars={need} (or 0 to derive it) or lower "
                "rollout.max_action_tokens")

    def ers_enabled(self, colocated: bool | None = None) -> tuple[bool, str]:
        """Whether elastic scaling runs, and why not when it does not. `controller.ers=on`
        with roles that are not whole cells is a ConfigError; `auto` then just stays off.

        `colocated`: whether the device plan shares devices between rollout and training (the
        job knows it once the platform is; before that only `cluster.colocate_rollout=true`
        does, and 'auto' is judged when the job resolves it)."""
        c = self.controller
        if c.ers == "off" or c.ers == "auto" and c.mode != "tiderl":
            return False, f"controller.ers={c.ers} (mode {c.mode})"
        if colocated is None:
            colocated = self.cluster.colocate_rollout is True
        if colocated:
            if c.ers == "on":
                raise ConfigError("config key 'controller.ers'='on' with "
                                  "rollout and training sharing devices (cluster.colocate_rollout="
                                  f"{self.cluster.colocate_rollout}): there are no cells to "
                                  "move; set controller.ers=off or "
                                  "cluster.colocate_rollout=false")
            return False, f"cluster.colocate_rollout={self.cluster.colocate_rollout} (shared)"
        if self.trainer.mode != "auto":
            if c.ers == "on":
                raise ConfigError(f"config key 'controller.ers'='on' needs trainer.mode='auto' "
                                  f"(ERS picks the RA2P mode), got {self.trainer.mode!r}")
            return False, f"trainer.mode={self.trainer.mode}"
        t, r = self.trainer, self.rollout
        if r.devices_per_rank != 1:
            if c.ers == "on":
                raise ConfigError(f"config key 'controller.ers'='on' with rollout."
                                  f"devices_per_rank={r.devices_per_rank}: elastic scaling "
                                  "moves cells of one-device rollout ranks; set "
                                  "rollout.devices_per_rank=1 or controller.ers=off")
            return False, f"rollout.devices_per_rank={r.devices_per_rank}"
        try:
            cell_size_for(ranks=r.ranks, devices_per_rank=r.devices_per_rank,
                          actor_devices=t.actor_devices, ref_devices=t.ref_devices,
                          fsdp=t.fsdp, model_parallel=t.model_parallel)
        except ConfigError as e:
            if c.ers == "on":
                raise
            return False, str(e)
        return True, ""

    def device_plan(self, n_devices: int, platform: str = "cpu") -> DevicePlan:
        """Roles on `n_devices` devices of `platform` (the one JAX started on): its defaults
        (`cluster.colocate_rollout=auto`) and the remedy a plan that does not fit names."""
        from tiderl.runtime.platforms import resolve_colocate

        r, t = self.rollout, self.trainer
        colocate = self.controller.mode == "sync" or resolve_colocate(
            self.cluster.colocate_rollout, platform=platform, n_devices=n_devices,
            separate_need=r.ranks * r.devices_per_rank + t.actor_devices + t.ref_devices,
            colocated_need=max(r.ranks * r.devices_per_rank, t.actor_devices + t.ref_devices))
        return plan_devices(
            n_devices,
            ranks=r.ranks,
            devices_per_rank=r.devices_per_rank,
            actor_devices=t.actor_devices,
            ref_devices=t.ref_devices,
            colocate_rollout=colocate,
            platform=platform,
        )

    def to_yaml(self) -> str:
        return dump_yaml(self)


def component_defaults() -> dict[str, Any]:
    """Each component's own defaults, without the embedded default run's toy choices: where
    presets for real models start (`base: components` at the top of the preset)."""
    return {**to_dict(RunConfig()), "rollout": to_dict(RolloutConfig()),
            "trainer": to_dict(TrainerConfig()), "env": to_dict(EnvConfig()),
            "controller": to_dict(ControllerConfig())}


# What a preset starts from: its top-level `base:` key (the embedded default run if absent).
BASES = {"default": lambda: _unresolved(to_dict(RunConfig())), "components": component_defaults}


def _unresolved(data: dict[str, Any]) -> dict[str, Any]:
    """A RunConfig's dict with the keys it derives set back to 'derive' (0), so a preset or an
    override changing what they derive from (rollout.max_action_tokens) moves them too."""
    data["env"]["max_action_chars"] = 0
    return data

# Model keys the run chooses; every other `model.*` key describes the network's shape, which a
# checkpoint (`model.checkpoint`, `model.init_from`) defines.
MODEL_RUN_KEYS = frozenset({"policy", "checkpoint", "init_from", "tokenizer", "param_dtype",
                            "compute_dtype", "init_std", "attention_impl", "scan_layers"})


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Defaults ← YAML preset at `path` ← dotted `overrides`; validated, or ConfigError.

    With `model.checkpoint` (or `model.init_from`) the checkpoint's shape fills every shape key
    of `model`; a shape key the preset or an override sets to another value is an error."""
    preset = load_yaml(path) if path else {}
    base = preset.pop("base", "default")
    if base not in BASES:
        raise ConfigError(f"config file {path!r}: 'base: {base}' is not one of "
                          f"{', '.join(BASES)}; 'default' starts from the embedded default run, "
                          "'components' from each component's own defaults")
    data: dict[str, Any] = merge(BASES[base](), preset)
    data = apply_overrides(RunConfig, data, overrides)
    explicit = merge(dict(preset.get("model") or {}),
                     apply_overrides(RunConfig, {}, overrides).get("model", {}))
    data["model"] = resolve_model(data["model"], explicit)
    return from_dict(RunConfig, data)


def resolve_model(model: dict[str, Any], explicit: dict[str, Any]) -> dict[str, Any]:
    """The `model` section with its shape taken from the checkpoint it names, if any.

    `explicit` holds the keys a preset or override set: those must agree with the checkpoint.
    `model.tokenizer`, when not set, becomes the checkpoint folder if it holds a tokenizer.json
    (or, for `model.init_from`, the source run's tokenizer), else the byte tokenizer.
    A `model.checkpoint` .gguf file becomes its converted HF folder (converted once, cached)."""
    if (ckpt := model.get("checkpoint")) and str(ckpt).lower().endswith(".gguf"):
        from tiderl.models.gguf import gguf_folder  # no JAX

        model = {**model, "checkpoint": str(gguf_folder(ckpt))}
    source, theirs = source_model(model)
    if source is None:
        return model
    shape = {k: v for k, v in theirs.items() if k not in MODEL_RUN_KEYS}
    wrong = [f"model.{k}={explicit[k]!r} (the checkpoint has {v!r})"
             for k, v in shape.items() if k in explicit and explicit[k] != v]
    if wrong:
        raise ConfigError(
            f"config key {wrong[0].split('=')[0]!r} disagrees with {source}: {'; '.join(wrong)}; "
            "the checkpoint defines the model's shape: drop these keys")
    out = {**model, **shape}
    if "tokenizer" not in explicit:
        if ckpt := model.get("checkpoint"):
            out["tokenizer"] = ckpt if (Path(ckpt) / "tokenizer.json").is_file() else "byte"
        else:
            out["tokenizer"] = str(theirs.get("tokenizer", "byte"))
    return out


def source_model(model: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(where it came from, its `model` keys) for `model.checkpoint` (read from config.json) or
    `model.init_from` (the source run's resolved config.yaml, whatever that run started from);
    (None, {}) when the model is initialised from its own keys."""
    if model.get("checkpoint") and model.get("init_from"):
        raise ConfigError("config keys 'model.checkpoint' and 'model.init_from' are both set; "
                          "start from one: an HF folder or a tiderl run")
    if model.get("checkpoint"):
        from tiderl.models.hf import load_hf_config  # reads config.json only

        try:
            hf = to_dict(load_hf_config(model["checkpoint"]))
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"config key 'model.checkpoint'={model['checkpoint']!r}: {e}") from e
        return f"model.checkpoint={model['checkpoint']!r}", hf
    if model.get("init_from"):
        run_dir, _ = split_init_from(model["init_from"])
        src = Path(run_dir) / "config.yaml"
        if not src.is_file():
            raise ConfigError(f"config key 'model.init_from'={model['init_from']!r}: no "
                              f"config.yaml in {run_dir!r}; name a folder a tiderl run wrote")
        return (f"model.init_from={model['init_from']!r}",
                dict(load_yaml(str(src)).get("model") or {}))
    return None, {}


def split_init_from(spec: str) -> tuple[str, int | None]:
    """'RUN_DIR' or 'RUN_DIR:STEP' → (RUN_DIR, STEP or None)."""
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isdigit():
        return head, int(tail)
    return spec, None


def default_preset() -> str:
    """The embedded default preset (configs/default.yaml next to the package, if shipped)."""
    return str(CONFIG_DIR / "default.yaml")


__all__ = ["ConfigError", "RunConfig", "load_config", "merge", "to_dict"]
