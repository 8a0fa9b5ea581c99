"""Policy models: the Flax NNX decoder family, HF import/export, tokenizers, turn templates."""

from tiderl._lazy import lazy_exports

_EXPORTS = {
    "ModelConfig": "tiderl.models.config",
    "Decoder": "tiderl.models.decoder",
    "AttentionCache": "tiderl.models.decoder",
    "Policy": "tiderl.models.policy",
    "build_policy": "tiderl.models.policy",
    "init_policy": "tiderl.models.policy",
    "policy_class": "tiderl.models.policy",
    "from_pretrained": "tiderl.models.hf",
    "save_pretrained": "tiderl.models.hf",
    "load_hf_config": "tiderl.models.hf",
    "ByteTokenizer": "tiderl.models.tokenizer",
    "HFTokenizer": "tiderl.models.tokenizer",
    "load_tokenizer": "tiderl.models.tokenizer",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
