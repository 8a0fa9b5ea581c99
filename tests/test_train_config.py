"""TrainerConfig validation: errors name 'trainer.<field>' and the fix."""

import pytest

from tiderl.config import RunConfig
from tiderl.configlib import ConfigError, apply_overrides, from_dict
from tiderl.train.config import TrainerConfig


@pytest.mark.parametrize("kw, key", [
    ({"clip_low": 1.5}, "trainer.clip_low"),
    ({"dual_clip": 0.5}, "trainer.dual_clip"),
    ({"is_cap": 0.0}, "trainer.is_cap"),
    ({"stale_loss": "ppo"}, "trainer.stale_loss"),
    ({"mode": "decoupled"}, "trainer.ref_devices"),
    ({"mode": "colocated", "ref_devices": 2}, "trainer.mode"),
    ({"row_len": 0}, "trainer.row_len"),
    ({"kl_coef": -1.0}, "trainer.kl_coef"),
])
def test_bad_values_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        TrainerConfig(**kw)


def test_colocated_mode_with_ref_devices_names_the_fix():
    with pytest.raises(ConfigError) as e:
        TrainerConfig(mode="colocated", ref_devices=2)
    assert "trainer.ref_devices=0" in str(e.value) and "\n" not in str(e.value)
    assert TrainerConfig(mode="colocated").ref_devices == 0
    assert TrainerConfig(mode="auto", ref_devices=2).mode == "auto"


def test_overrides_reach_trainer_fields():
    data = apply_overrides(RunConfig, {}, ["trainer.kl_estimator=k2", "trainer.loss_agg=seq_mean",
                                           "trainer.offload=always"])
    cfg = from_dict(RunConfig, data)
    assert (cfg.trainer.kl_estimator, cfg.trainer.loss_agg, cfg.trainer.offload) == \
        ("k2", "seq_mean", "always")
    with pytest.raises(ConfigError, match="trainer.kl_estimator"):
        from_dict(RunConfig, apply_overrides(RunConfig, {}, ["trainer.kl_estimator=k4"]))
