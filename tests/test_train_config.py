"""TrainerConfig validation: errors name 'trainer.<field>' and the fix."""

import pytest

from tiderl.config import RunConfig
from tiderl.configlib import ConfigError, apply_overrides, from_dict
from tiderl.train.config import TrainerConfig


@pytest.mark.parametrize("kw, key", [
    ({"clip_low": 1.5}, "trainer.clip_low"),
    ({"dual_clip": 0.5}, "trainer.dual_clip"),
    ({"is_cap": 0.0}, "trainer.is_cap"),
    ({"batch_min": 8, "batch_ideal": 4}, "trainer.batch_ideal"),
    ({"mode": "decoupled"}, "trainer.ref_devices"),
    ({"row_len": 0}, "trainer.row_len"),
    ({"kl_coef": -1.0}, "trainer.kl_coef"),
])
def test_bad_values_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        TrainerConfig(**kw)


def test_overrides_reach_trainer_fields():
    data = apply_overrides(RunConfig, {}, ["trainer.kl_estimator=k2", "trainer.loss_agg=seq_mean",
                                           "trainer.offload=always"])
    cfg = from_dict(RunConfig, data)
    assert (cfg.trainer.kl_estimator, cfg.trainer.loss_agg, cfg.trainer.offload) == \
        ("k2", "seq_mean", "always")
    with pytest.raises(ConfigError, match="trainer.kl_estimator"):
        from_dict(RunConfig, apply_overrides(RunConfig, {}, ["trainer.kl_estimator=k4"]))
