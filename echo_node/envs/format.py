"""How an episode's messages become tokens: the first observation, and what the environment
appends after each model turn.

Token in, token out: the model's tokens are kept exactly as sampled (re-encoding its text could
split it otherwise, and the learner's log-probs must be of the very tokens sampled); only the
environment's answers are rendered, each as the tokens the chat template puts between the end
of the model's turn and the start of its next one. Peer and learner render with the same format,
so the learner's re-run of the environment reproduces every environment turn token for token.

- `CharFormat` (the embedded model's character tokenizer): the first observation is the prompt
  (bos + text; no template, so no tool schemas: its tools are conventions of the prompt's
  alphabet); an answer is its text. A model turn that hit its token budget without eos is
  closed by an eos the environment's turn supplies.
- `ChatFormat` (a Hugging Face tokenizer with a chat template): the first observation is one
  user turn plus the generation prompt, rendered with the environment's tool schemas (a
  template that lists tools puts them in its system turn; one that does not ignores them); an
  answer is the template's close of the assistant turn, the answer's message, and the next
  generation prompt, found by rendering a conversation around a sentinel. An answer's content
  is rendered with every special-token string of the tokenizer removed: tool output (which may
  echo the model's text) cannot close a turn or open a role.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from echo_node.envs import EnvError, Message
from echo_node.ml.tokenizer import CharTokenizer, HFTokenizerAdapter, Tokenizer

_SENTINEL = "\u2063ECHO-NODE-ACTION\u2063"


class EpisodeFormat(Protocol):
    eos_id: int

    def first_ids(self, observation: Message, tools: Sequence[Mapping[str, Any]] = ()) -> list[int]: ...

    def next_ids(self, observation: Message, *, after_eos: bool) -> list[int]: ...

    def action_text(self, ids: Sequence[int]) -> str: ...


class CharFormat:
    def __init__(self, tokenizer: CharTokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_id

    def _encode(self, content: str) -> list[int]:
        try:
            return self.tokenizer.encode(content)
        except ValueError as exc:
            raise EnvError(f"an observation the tokenizer cannot encode: {exc}") from None

    def first_ids(self, observation: Message, tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        return [self.tokenizer.bos_id, *self._encode(observation["content"])]

    def next_ids(self, observation: Message, *, after_eos: bool) -> list[int]:
        return ([] if after_eos else [self.eos_id]) + self._encode(observation["content"])

    def action_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)


class ChatFormat:
    def __init__(self, tokenizer: HFTokenizerAdapter) -> None:
        hf = tokenizer.hf
        if not getattr(hf, "chat_template", None):
            raise EnvError(f"a multi-turn environment needs a tokenizer with a chat template ({tokenizer.path})")
        self.tokenizer = tokenizer
        self.hf = hf
        self.eos_id = tokenizer.eos_id
        specials = {str(t) for t in getattr(hf, "all_special_tokens", [])}
        specials |= {str(t) for t in getattr(hf, "added_tokens_encoder", {})}
        self._specials = sorted((s for s in specials if s), key=len, reverse=True)
        self._eos_text = str(hf.convert_ids_to_tokens(self.eos_id))

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool,
                tools: Sequence[Mapping[str, Any]] = ()) -> str:
        return str(self.hf.apply_chat_template(messages, tools=[dict(t) for t in tools] or None,
                                               add_generation_prompt=generation_prompt, tokenize=False))

    def clean(self, content: str) -> str:
        """`content` without any special-token string, repeated until none is left (removing
        one can join the halves of another)."""
        while True:
            before = content
            for s in self._specials:
                content = content.replace(s, "")
            if content == before:
                return content

    def _message(self, observation: Message) -> dict[str, str]:
        return {"role": observation["role"], "content": self.clean(observation["content"])}

    def first_ids(self, observation: Message, tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        return self.tokenizer.encode(self._render([self._message(observation)], generation_prompt=True, tools=tools))

    def next_ids(self, observation: Message, *, after_eos: bool) -> list[int]:
        user = {"role": "user", "content": "q"}
        turn = {"role": "assistant", "content": _SENTINEL}
        base = self._render([user, turn], generation_prompt=False)
        full = self._render([user, turn, self._message(observation)], generation_prompt=True)
        if not full.startswith(base) or _SENTINEL not in base:
            raise EnvError("the chat template renders a conversation's prefix differently once it grows; it cannot be used for episodes")
        close = base[base.index(_SENTINEL) + len(_SENTINEL):]
        # The model's own eos already closed its turn when the template closes turns with eos.
        if after_eos and close.startswith(self._eos_text):
            close = close[len(self._eos_text):]
        return self.tokenizer.encode(close + full[len(base):])

    def action_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)


def episode_format(tokenizer: Tokenizer) -> EpisodeFormat:
    """The format of a run's tokenizer."""
    if isinstance(tokenizer, CharTokenizer):
        return CharFormat(tokenizer)
    if isinstance(tokenizer, HFTokenizerAdapter):
        return ChatFormat(tokenizer)
    raise EnvError(f"no episode format for a {type(tokenizer).__name__}")

