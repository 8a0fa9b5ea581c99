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
    ("rollout.devices_per_rank=2", "rollout.devices_per_rank"),
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
