"""Config: presets, dotted overrides, and one-line errors that name the key."""

import dataclasses

import pytest

from tiderl.config import CONFIG_DIR, RunConfig, load_config
from tiderl.configlib import ConfigError


def test_defaults_equal_embedded_preset():
    assert load_config(str(CONFIG_DIR / "default.yaml")) == RunConfig()


def test_preset_and_overrides_compose():
    cfg = load_config(str(CONFIG_DIR / "tiny-8dev.yaml"),
                      ["trainer.lr=1e-5", "rollout.ranks=3", "model.qkv_bias=true"])
    assert cfg.trainer.lr == 1e-5 and isinstance(cfg.trainer.lr, float)
    assert cfg.rollout.ranks == 3 and cfg.trainer.actor_devices == 4
    assert cfg.model.qkv_bias is True
    assert dataclasses.is_dataclass(cfg) and cfg.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]


@pytest.mark.parametrize("override,key", [
    ("trainer.lrr=1e-5", "trainer.lrr"),
    ("nosuch.section=1", "nosuch"),
    ("trainer.lr=fast", "trainer.lr"),
    ("rollout.ranks=2.5", "rollout.ranks"),
    ("rollout.ranks=true", "rollout.ranks"),
    ("model.param_dtype=float64", "model.param_dtype"),
    ("model.n_kv_heads=3", "model.n_kv_heads"),
    ("trainer.lr.x=1", "trainer.lr"),
    ("rollout.max_context=100000", "rollout.max_context"),
    ("rollout.num_pages=2", "rollout.num_pages"),
    ("rollout.devices_per_rank=3", "rollout.devices_per_rank"),
    ("rollout.stop_tokens=[-1]", "rollout.stop_tokens"),
])
def test_bad_inputs_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert key in msg and "\n" not in msg


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match="did you mean 'trainer.lr'"):
        load_config(None, ["trainer.lrr=1"])


def test_impossible_device_plan_names_the_key():
    cfg = load_config(None, ["rollout.ranks=6", "trainer.actor_devices=2", "trainer.ref_devices=1"])
    with pytest.raises(ConfigError, match="rollout.ranks") as e:
        cfg.device_plan(8)
    assert "9 devices" in str(e.value) and "8 are visible" in str(e.value)
    plan = load_config(str(CONFIG_DIR / "tiny-8dev.yaml")).device_plan(8)
    assert plan.rollout == ((0,), (1,)) and plan.actor == (2, 3, 4, 5) and plan.ref == (6, 7)


def test_bad_yaml_file_is_named(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("trainer: [1, 2")
    with pytest.raises(ConfigError, match="x.yaml"):
        load_config(str(p))
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("overrides,key,fix", [
    # A trajectory is packed into one training row: longer contexts could never be trained.
    (["rollout.max_context=256"], "rollout.max_context", "trainer.row_len"),
    (["rollout.max_context=256", "trainer.row_len=200"], "rollout.max_context", "trainer.row_len"),
    # Truncated sampling with full-vocabulary behaviour logprobs biases the GRPO ratios.
    (["rollout.top_k=20"], "rollout.top_k", "rollout.top_k=0"),
    (["rollout.top_p=0.9"], "rollout.top_p", "rollout.top_p=1.0"),
    # The byte tokenizer's turn template has no system role.
    (["controller.system_prompt=Play well."], "controller.system_prompt",
     "controller.system_prompt=''"),
])
def test_impossible_run_configs_are_rejected_at_config_time(overrides, key, fix):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    msg = str(e.value)
    assert f"config key '{key}'" in msg and fix in msg and "\n" not in msg, msg


def test_context_that_fits_a_row_is_accepted():
    cfg = load_config(None, ["rollout.max_context=256", "trainer.row_len=256"])
    assert cfg.rollout.max_context == cfg.trainer.row_len == 256


@pytest.mark.parametrize("override", [
    "trainer.batch_min=1", "trainer.batch_ideal=64",              # controller.groups_per_step
    "trainer.checkpoint_every=5", "trainer.keep_checkpoints=3",   # controller.checkpoint_*
    "controller.eval_groups=8",                                   # env.eval_groups
    "controller.max_turns=4",                                     # env.max_turns
])
def test_removed_duplicate_keys_are_unknown(override):
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(None, [override])


def test_env_max_turns_is_the_one_turn_limit_and_the_default_run_keeps_four():
    cfg = RunConfig()
    assert cfg.env.max_turns == 4
    assert load_config(None, ["env.max_turns=6"]).env.max_turns == 6


def test_wide_bf16_preset_is_the_default_run_with_a_wider_policy():
    """configs/wide-bf16.yaml changes only the policy's width, the learning rate, the compute
    dtype and the run's length of the embedded default."""
    cfg = load_config(str(CONFIG_DIR / "wide-bf16.yaml"))
    base = RunConfig()
    assert (cfg.model.d_model, cfg.model.compute_dtype, cfg.trainer.lr) == (512, "bfloat16", 1e-3)
    assert cfg.model.n_heads * cfg.model.head_dim == cfg.model.d_model
    assert cfg.env == base.env and cfg.rollout == base.rollout
    assert dataclasses.replace(cfg.trainer, lr=base.trainer.lr) == base.trainer
    assert cfg.controller.steps == 100 and cfg.controller.eval_every == 25


def test_a_vision_language_policy_on_several_processes_is_refused_at_config_time():
    """Images do not cross processes yet: a VLM run on --num-processes 2 is refused before
    any process joins a world (each turn and step would otherwise refuse its images)."""
    path = str(CONFIG_DIR / "vlm-smoke.yaml")
    with pytest.raises(ConfigError, match=r"config key 'model.vision' on 2 processes: images do "
                                          r"not cross processes yet.*distributed.coordinator"):
        load_config(path, ["distributed.coordinator=127.0.0.1:8476",
                           "distributed.num_processes=2", "distributed.process_id=0"])
    assert load_config(path, ["distributed.coordinator=127.0.0.1:8476",
                              "distributed.num_processes=1", "distributed.process_id=0"])


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_preset_loads(path):
    """A preset that no longer validates fails here, not in a user's first command. The GPU
    presets take their context length from a checkpoint (model.checkpoint): given it here."""
    extra = ["model.max_seq_len=4096"] if path.name.startswith("gpu-") else []
    cfg = load_config(str(path), extra)
    assert cfg.rollout.max_context <= cfg.trainer.row_len
