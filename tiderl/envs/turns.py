"""`TurnTemplate`: where the special tokens go around observations and actions. No JAX.

The base the template families build on: `tiderl.envs.chat_templates` (a checkpoint's own
Jinja template) subclasses it, and `tiderl.envs.templates` (byte, chatml, llama3, the dispatch
`template_for`) builds the others and re-exports it; neither of those is imported here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

Part = str | int  # text, or a special token id


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class TurnTemplate:
    """Where the special tokens go around user observations and assistant actions."""

    tokenizer: Any
    name: str
    begin: tuple[Part, ...]
    user_open: tuple[Part, ...]
    user_close: tuple[Part, ...]
    assistant_open: tuple[Part, ...]
    stop: tuple[int, ...]
    """Tokens that end an action; the first is the one a truncated action is closed with."""
    after_action: tuple[Part, ...] = ()
    """Template text following an action's stop token (ChatML's newline); not model-generated."""
    system_open: tuple[Part, ...] = ()
    system_close: tuple[Part, ...] = ()
    extra_stop: tuple[int, ...] = ()
    """Also end an action (e.g. <|endoftext|>) but are not used to close one."""
    default_system: tuple[Part, ...] = ()
    """Written where the system turn goes when no system prompt is given (Qwen2.5's default
    system message, Llama 3.1's date header)."""

    @property
    def stop_ids(self) -> frozenset[int]:
        """Token ids that end an action (the engine's stop set)."""
        return frozenset(self.stop + self.extra_stop)

    def render(self, parts: Iterable[Part]) -> list[int]:
        """Token ids of `parts`, encoding each run of adjacent text once."""
        ids: list[int] = []
        run: list[str] = []
        for p in parts:
            if isinstance(p, str):
                run.append(p)
                continue
            if run:
                ids += self.tokenizer.encode("".join(run))
                run = []
            ids.append(int(p))
        if run:
            ids += self.tokenizer.encode("".join(run))
        return ids

    def _user_text(self, text: str) -> str:
        return text

    def _system_text(self, text: str) -> str:
        return text

    def _user_turn(self, text: str) -> list[Part]:
        return [*self.user_open, self._user_text(text), *self.user_close, *self.assistant_open]

    def prompt(self, observation: str, *, system: str | None = None) -> list[int]:
        """The task's first prefill: begin, optional system turn, first observation, and the
        assistant header the action is generated after."""
        parts: list[Part] = list(self.begin)
        if system is None:
            parts += self.default_system
        else:
            if not self.system_open:
                raise ValueError(f"template {self.name!r} has no system turn; pass system=None")
            parts += [*self.system_open, self._system_text(system), *self.system_close]
        return self.render(parts + self._user_turn(observation))

    def observation(self, text: str, *, action_stopped: bool = True) -> list[int]:
        """Tokens that follow an action: (a closing stop token if the action was cut off at the
        action limit), the template's tail, the observation turn and the next assistant
        header."""
        parts: list[Part] = [] if action_stopped else [self.stop[0]]
        return self.render(parts + [*self.after_action] + self._user_turn(text))

    def action_text(self, action_ids: Sequence[int]) -> str:
        """The action as text for the env: the sampled ids, without a final stop token."""
        ids = list(action_ids)
        if ids and ids[-1] in self.stop_ids:
            ids.pop()
        return self.tokenizer.decode(ids)

    def stopped(self, action_ids: Sequence[int]) -> bool:
        return bool(action_ids) and action_ids[-1] in self.stop_ids
