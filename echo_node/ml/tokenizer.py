"""Tokenizers for the policy: an in-process character tokenizer and a thin HF adapter.

Both expose the same small interface (`Tokenizer`), so the learner, the rollout peers and the
engines never care which one a run uses.

Invariants:
- `encode(text)` never adds special tokens; `encode_prompt(text)` is the ONE place a bos token is
  prepended. Engines and the learner receive prompt ids that already carry bos (when the
  tokenizer has one) and add nothing themselves.
- `decode(ids)` stops at the first eos and drops pad/bos, so a completion's text is exactly what
  a reward function sees.
- `CharTokenizer.from_dict(t.to_dict())` encodes and decodes identically to `t`; the dict is
  small and JSON-able so it travels inside a run spec.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, Protocol


class Tokenizer(Protocol):
    """What the ML code needs from a tokenizer."""

    # Read-only in the protocol, so a tokenizer that always has a bos (an int) conforms.
    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


DEFAULT_ALPHABET = "0123456789+= "


class CharTokenizer:
    """One id per character of `alphabet`, after three specials: pad=0, bos=1, eos=2."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    _N_SPECIAL = 3

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if not alphabet:
            raise ValueError("CharTokenizer needs a non-empty alphabet")
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"CharTokenizer alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self.vocab_size = self._N_SPECIAL + len(alphabet)
        self._to_id = {ch: i + self._N_SPECIAL for i, ch in enumerate(alphabet)}

    def encode(self, text: str) -> list[int]:
        try:
            return [self._to_id[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(
                f"character {exc.args[0]!r} is not in the tokenizer alphabet {self.alphabet!r}"
            ) from None

    def encode_prompt(self, text: str) -> list[int]:
        return [self.bos_id, *self.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            j = i - self._N_SPECIAL
            if not 0 <= j < len(self.alphabet):
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(self.alphabet[j])
        return "".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "char", "alphabet": self.alphabet}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CharTokenizer:
        if d.get("kind") != "char" or not isinstance(d.get("alphabet"), str):
            raise ValueError(f"not a char tokenizer spec: {d!r}")
        return cls(d["alphabet"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.alphabet == self.alphabet

    def __hash__(self) -> int:
        return hash(("char", self.alphabet))


class HFTokenizerAdapter:
    """The `Tokenizer` interface over a transformers tokenizer (for `--model PATH`).

    `chat`: `encode_prompt` renders the text as one user turn of the tokenizer's chat template
    with the generation prompt after it (what an instruction-tuned model expects); the template
    adds its own special tokens, so no bos is prepended then.
    """

    def __init__(self, hf_tokenizer: Any, *, path: str | None = None, chat: bool = False) -> None:
        self.hf = hf_tokenizer
        self.path = path
        self.chat = chat
        if chat and not getattr(hf_tokenizer, "chat_template", None):
            raise ValueError(f"the task asks for chat prompts, but the tokenizer at {path} has no chat template")
        eos = hf_tokenizer.eos_token_id
        if eos is None:
            raise ValueError("the HF tokenizer has no eos token; generation could never stop")
        self.eos_id: int = int(eos)
        self.bos_id: int | None = (
            None if hf_tokenizer.bos_token_id is None else int(hf_tokenizer.bos_token_id)
        )
        # Many causal LMs ship without a pad token; padded positions are always masked out,
        # so reusing eos is safe and is what HF generate does too.
        pad = hf_tokenizer.pad_token_id
        self.pad_id: int = self.eos_id if pad is None else int(pad)
        self.vocab_size: int = len(hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        if self.chat:
            rendered = self.hf.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            return self.encode(str(rendered))
        ids = self.encode(text)
        return ids if self.bos_id is None else [self.bos_id, *ids]

    def fingerprint(self) -> str:
        """SHA-256 over what decides the ids: vocabulary, merges, normalizer and pre-tokenizer
        (the fast tokenizer's JSON), the special tokens and the chat template."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        parts = {
            "tokenizer": backend.to_str() if backend is not None else sorted(self.hf.get_vocab().items()),
            "specials": [self.bos_id, self.eos_id, self.pad_id],
            "chat_template": getattr(self.hf, "chat_template", None) if self.chat else None,
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return str(self.hf.decode(ids, skip_special_tokens=True))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "hf", "sha256": self.fingerprint(), "chat": self.chat}


def load_tokenizer(spec: dict[str, Any], model_path: str | None = None) -> Tokenizer:
    """Build the tokenizer a run spec names; `model_path` is where an "hf" tokenizer lives locally."""
    kind = spec.get("kind")
    if kind == "char":
        return CharTokenizer.from_dict(spec)
    if kind == "hf":
        path = model_path or spec.get("path")
        if not path:
            raise ValueError("an 'hf' tokenizer needs a local model path (--model PATH)")
        from transformers import AutoTokenizer  # imported lazily: heavy, and only for real models

        return HFTokenizerAdapter(AutoTokenizer.from_pretrained(path), path=str(path))
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'char' or 'hf'")
