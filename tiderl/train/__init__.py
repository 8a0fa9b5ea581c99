"""tiderl.train: GRPO, deferred-KL Ref/Actor kernels, the RA2P backend, dispatch, checkpoints."""

from tiderl._lazy import lazy_exports

_EXPORTS = {
    "TrainerConfig": "tiderl.train.config",
    "group_advantages": "tiderl.train.advantages",
    "GroupAdvantages": "tiderl.train.advantages",
    "Trajectory": "tiderl.train.dispatch",
    "MicroBatch": "tiderl.train.dispatch",
    "microbatches": "tiderl.train.dispatch",
    "plan_microbatches": "tiderl.train.dispatch",
    "pack_microbatch": "tiderl.train.dispatch",
    "elastic_take": "tiderl.train.dispatch",
    "PhaseCosts": "tiderl.train.ra2p",
    "choose_mode": "tiderl.train.ra2p",
    "c_dec": "tiderl.train.ra2p",
    "c_col": "tiderl.train.ra2p",
    "LossSpec": "tiderl.train.grpo",
    "TrainerBackend": "tiderl.train.backend",
    "Checkpointer": "tiderl.train.checkpoint",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
