"""Turn templates: prompts, actions and observations as token ids for a model family. No JAX.

The trajectory is kept as token ids end to end: the first prompt and every observation are
rendered here once, the action tokens are exactly what the engine sampled (never decoded and
re-encoded), and `Transcript` records a loss mask that is 1 on action tokens only.

Templates work on any tokenizer with `encode(str) -> list[int]` (no specials added),
`decode(list[int]) -> str`, `token_to_id(str)` and the ids `bos_id`, `eos_id`, `im_start_id`,
`im_end_id` (see tiderl/models/tokenizer.py). Text between special tokens is encoded as one run,
as a tokenizer would encode the whole rendered chat, so HF tokenizers give the same ids as
`apply_chat_template` (tests check ChatML against transformers).

Families:
  byte    <bos><im_start>obs<im_end><im_start> action<im_end> <im_start>obs<im_end><im_start> ...
          (the embedded default: role markers only, no role names, so tiny models see few tokens)
  chatml  Qwen2 / Qwen2.5: <|im_start|>user\\nobs<|im_end|>\\n<|im_start|>assistant\\n ...
  llama3  <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\nobs<|eot_id|>...
  jinja   the checkpoint's own chat template (tokenizer_config.json / chat_template.jinja),
          decomposed into these pieces once (tiderl/envs/chat_templates.py); 'auto' prefers it

`TurnTemplate` itself is in `tiderl.envs.turns` (re-exported here), so the imports run one
way: templates -> chat_templates -> turns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from tiderl.envs.chat_templates import jinja_template
from tiderl.envs.turns import Part, Tokenizer, TurnTemplate

__all__ = ["FAMILIES", "Part", "Tokenizer", "Transcript", "TurnTemplate", "byte_template",
           "checkpoint_template", "chatml_template", "llama3_template", "template_for"]


@dataclasses.dataclass
class Transcript:
    """One task's token ids and loss mask, appended turn by turn (no re-tokenisation)."""

    template: TurnTemplate
    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    action_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """[start, end) of each action in `tokens`."""
    _stopped: bool = True

    @classmethod
    def start(cls, template: TurnTemplate, observation: str, *, system: str | None = None,
              expand: Callable[[list[int]], list[int]] | None = None) -> Transcript:
        """`expand`: rewrites the rendered ids (a vision-language policy's image placeholders
        repeated to each image's token count)."""
        t = cls(template)
        if system is not None and not template.system_open:
            # A template with no system role (the byte one, a checkpoint template that has none):
            # the system text leads the first observation, as such chat templates fold it.
            observation, system = f"{system}\n\n{observation}", None
        ids = template.prompt(observation, system=system)
        t._extend(ids if expand is None else expand(list(ids)), 0)
        return t

    def _extend(self, ids: Sequence[int], mask: int) -> None:
        self.tokens += ids
        self.loss_mask += [mask] * len(ids)

    def add_action(self, action_ids: Sequence[int]) -> str:
        """Appends the sampled action ids (loss mask 1); returns the action text for the env."""
        start = len(self.tokens)
        self._extend(action_ids, 1)
        self.action_spans.append((start, len(self.tokens)))
        self._stopped = self.template.stopped(action_ids)
        return self.template.action_text(action_ids)

    def add_observation(self, text: str,
                        expand: Callable[[list[int]], list[int]] | None = None) -> list[int]:
        """Appends the env's reply (loss mask 0; `expand` as in `start`); returns the new ids
        (the next prefill)."""
        ids = self.template.observation(text, action_stopped=self._stopped)
        if expand is not None:
            ids = expand(list(ids))
        self._extend(ids, 0)
        self._stopped = True
        return ids

    def __len__(self) -> int:
        return len(self.tokens)


def _special(tok: Any, *names: str, attr: str | None = None) -> int:
    if attr is not None and getattr(tok, attr, None) is not None:
        return int(getattr(tok, attr))
    for n in names:
        i = tok.token_to_id(n) if hasattr(tok, "token_to_id") else None
        if i is not None:
            return int(i)
    raise ValueError(f"tokenizer {type(tok).__name__} has none of the special tokens "
                     f"{names}; pick a template family that matches the tokenizer")


def byte_template(tok: Any) -> TurnTemplate:
    """Role markers only: the compact default for the byte tokenizer and tiny models."""
    ims = _special(tok, "<|im_start|>", attr="im_start_id")
    ime = _special(tok, "<|im_end|>", attr="im_end_id")
    bos = _special(tok, "<bos>", "<s>", attr="bos_id")
    return TurnTemplate(tok, "byte", begin=(bos,), user_open=(ims,), user_close=(ime,),
                        assistant_open=(ims,), stop=(ime,))


def chatml_template(tok: Any) -> TurnTemplate:
    """ChatML, as Qwen2/Qwen2.5 use it (no default system prompt is inserted)."""
    ims = _special(tok, "<|im_start|>")
    ime = _special(tok, "<|im_end|>")
    # Qwen also stops on <|endoftext|>; looked up by name, since an eos_id of 0 is easy to lose.
    eos = tok.token_to_id("<|endoftext|>")
    if eos is None:
        eos = getattr(tok, "eos_id", None)
    return TurnTemplate(
        tok, "chatml", begin=(), user_open=(ims, "user\n"), user_close=(ime, "\n"),
        assistant_open=(ims, "assistant\n"), stop=(ime,), after_action=("\n",),
        system_open=(ims, "system\n"), system_close=(ime, "\n"),
        extra_stop=() if eos is None or eos == ime else (int(eos),))


def llama3_template(tok: Any) -> TurnTemplate:
    """Llama 3 headers (no default system prompt or date line is inserted)."""
    bot = _special(tok, "<|begin_of_text|>")
    sh, eh = _special(tok, "<|start_header_id|>"), _special(tok, "<|end_header_id|>")
    eot = _special(tok, "<|eot_id|>")
    eos = tok.token_to_id("<|end_of_text|>")
    return TurnTemplate(
        tok, "llama3", begin=(bot,), user_open=(sh, "user", eh, "\n\n"), user_close=(eot,),
        assistant_open=(sh, "assistant", eh, "\n\n"), stop=(eot,),
        system_open=(sh, "system", eh, "\n\n"), system_close=(eot,),
        extra_stop=() if eos is None else (int(eos),))


def checkpoint_template(tok: Any) -> TurnTemplate:
    """The tokenizer's own Jinja chat template, rendered turn by turn (tiderl.envs.chat_templates)."""
    return jinja_template(tok)


FAMILIES = {"byte": byte_template, "chatml": chatml_template, "llama3": llama3_template,
            "jinja": checkpoint_template, "checkpoint": checkpoint_template}


def template_for(tok: Any, family: str = "auto") -> TurnTemplate:
    """The template `family` for `tok`. 'auto' prefers the tokenizer's own chat_template (from
    its checkpoint folder), else picks byte, chatml or llama3 from its special tokens."""
    if family != "auto":
        if family not in FAMILIES:
            raise ValueError(f"unknown template family {family!r}; use auto, "
                             f"{', '.join(FAMILIES)}")
        return FAMILIES[family](tok)
    if getattr(tok, "chat_template", None):
        return checkpoint_template(tok)
    lookup = getattr(tok, "token_to_id", lambda _: None)
    if (getattr(tok, "vocab_size", 1 << 30) <= 512 and getattr(tok, "bos_id", None) is not None
            and getattr(tok, "im_start_id", None) is not None and tok.encode("ab") == [97, 98]):
        return byte_template(tok)  # a byte tokenizer: ids are the bytes themselves
    if lookup("<|im_start|>") is not None:
        return chatml_template(tok)
    if lookup("<|start_header_id|>") is not None:
        return llama3_template(tok)
    raise ValueError(f"cannot tell the chat template of {type(tok).__name__}; set the template "
                     f"family explicitly ({', '.join(FAMILIES)})")
