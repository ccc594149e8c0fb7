"""Multi-turn episodes on the wire: strict, bounded encode/decode. No I/O.

Job: the rollout record of an agentic run. A model acts, an environment answers, the model acts
again; the learner trains on the model's tokens only and re-runs the environment on the model's
actions to check every answer (echo_node/envs/verify.py).

Shape (each a msgpack array of its fields, as in messages.py):
- `Turn`: the tokens of one turn, in order. A model turn (`from_env` False) carries, per token,
  the behaviour log-prob and the weight version that sampled it. An environment turn carries
  neither: its tokens are the environment's answer as the run's chat format renders it, and the
  loss never sees them. The loss mask therefore travels run-length encoded, as the turns' roles:
  there is no separate mask that could disagree with the tokens.
- `Episode`: the turns after the first observation, alternating model, environment, model, ...
  and ending with a model turn; its `reward` is the episode's return (the sum of the rewards the
  environment gave). Versions never decrease along an episode, across turns included: a weight
  swap between (or inside) turns moves forward, and the turns after it carry the new version.
- `EpisodeGroup`: the episodes of one (environment, seed): GRPO's group. Every episode of it
  begins with the same first observation (`prompt_ids`), since a deterministic environment
  answers `reset(seed)` the same way. The seed is not on the wire: it is the slot's draw
  (protocol/assignment.py), recomputed by the learner from the batch's seq and the group's index.
- `EpisodeBatch`: the groups of one generation batch, named and signed by their publisher like
  a `RolloutBatch` (same seq space: a publisher numbers both kinds with one counter).

Bounds (what a decoder accepts, whatever the run): at most MAX_EPISODE_TURNS turns of which each
holds 1..MAX_TURN_TOKENS tokens, at most MAX_EPISODE_TOKENS tokens over all turns of an episode.
A run's own budgets (turns, tokens per turn and per episode) are narrower and are the learner's
to enforce (`check_budgets`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Final

from protocol.fields import (
    WireMessage, _fail, _float, _int, _ints, _logprobs, _nested_seq, _peer_id, _run_id, _seq, _set, _str, _token_versions,
)
from protocol.limits import (
    MAX_ABS_REWARD,
    MAX_BATCH_GROUPS,
    MAX_GROUP_SIZE,
    MAX_NAME_LEN,
    MAX_PROMPT_TOKENS,
    MAX_SEQ,
    MAX_TOKENS_PER_SEQUENCE,
    MAX_VERSION,
    MAX_VOCAB,
)

__all__ = [
    "MAX_EPISODE_TOKENS",
    "MAX_EPISODE_TURNS",
    "MAX_TURN_TOKENS",
    "Budgets",
    "Episode",
    "EpisodeBatch",
    "EpisodeGroup",
    "Turn",
    "check_budgets",
]

# Turns in one episode, model and environment together (64 model actions).
MAX_EPISODE_TURNS: Final = 127
# Tokens of one turn, and of all turns of an episode: the learner's forward runs the first
# observation and every turn as one sequence, so the episode is bounded like a completion.
MAX_TURN_TOKENS: Final = MAX_TOKENS_PER_SEQUENCE
MAX_EPISODE_TOKENS: Final = MAX_TOKENS_PER_SEQUENCE


@dataclass(frozen=True, kw_only=True, slots=True)
class Turn(WireMessage):
    """One turn's tokens; a model turn's log-probs and versions, none for an environment turn."""

    from_env: bool
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]

    def __post_init__(self) -> None:
        w = "Turn"
        if not isinstance(self.from_env, bool):
            _fail(f"{w}.from_env", f"expected a bool, got {type(self.from_env).__name__}")
        ids = _ints(f"{w}.token_ids", self.token_ids, MAX_TURN_TOKENS, 0, MAX_VOCAB - 1, min_len=1)
        n = 0 if self.from_env else len(ids)
        role = "an environment turn carries none" if self.from_env else f"one per token ({len(ids)})"
        lps = _logprobs(f"{w}.logprobs", self.logprobs, MAX_TURN_TOKENS)
        if len(lps) != n:
            _fail(f"{w}.logprobs", f"{len(lps)} log-probs: {role}")
        vs = _token_versions(f"{w}.versions", self.versions, MAX_TURN_TOKENS, MAX_VERSION)
        if len(vs) != n:
            _fail(f"{w}.versions", f"{len(vs)} versions: {role}")
        _set(self, "token_ids", ids)
        _set(self, "logprobs", lps)
        _set(self, "versions", vs)


@dataclass(frozen=True, kw_only=True, slots=True)
class Episode(WireMessage):
    """The turns after the first observation: model, environment, ..., model (module docstring)."""

    _NESTED_TUPLE: ClassVar[Mapping[str, tuple[type[WireMessage], int]]] = {"turns": (Turn, MAX_EPISODE_TURNS)}

    turns: tuple[Turn, ...]
    reward: float

    def __post_init__(self) -> None:
        w = "Episode"
        turns = _nested_seq(f"{w}.turns", self.turns, Turn, MAX_EPISODE_TURNS, min_len=1)
        for i, t in enumerate(turns):
            if t.from_env != (i % 2 == 1):
                _fail(f"{w}.turns[{i}]", "turns alternate model, environment, model, ...")
        if turns[-1].from_env:
            _fail(f"{w}.turns", "an episode ends with a model turn")
        total = sum(len(t.token_ids) for t in turns)
        if total > MAX_EPISODE_TOKENS:
            _fail(f"{w}.turns", f"{total} tokens in all, above {MAX_EPISODE_TOKENS}")
        last = -1
        for i, t in enumerate(turns):
            if t.versions and t.versions[0] < last:
                _fail(f"{w}.turns[{i}].versions", f"begins at {t.versions[0]}, before the previous turn's {last}")
            if t.versions:
                last = t.versions[-1]
        _set(self, "turns", turns)
        _set(self, "reward", _float(f"{w}.reward", self.reward, -MAX_ABS_REWARD, MAX_ABS_REWARD))

    @property
    def model_turns(self) -> tuple[Turn, ...]:
        return self.turns[0::2]

    @property
    def num_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns)

    @property
    def first_version(self) -> int:
        """The version that sampled the episode's first token (the slot's version)."""
        return self.turns[0].versions[0]

    @property
    def max_version(self) -> int:
        return self.turns[-1].versions[-1]


@dataclass(frozen=True, kw_only=True, slots=True)
class EpisodeGroup(WireMessage):
    """The episodes of one (environment, seed), all from the same first observation."""

    _NESTED_TUPLE: ClassVar[Mapping[str, tuple[type[WireMessage], int]]] = {"episodes": (Episode, MAX_GROUP_SIZE)}

    group_id: str
    prompt_ids: tuple[int, ...]
    episodes: tuple[Episode, ...]

    def __post_init__(self) -> None:
        w = "EpisodeGroup"
        _set(self, "group_id", _str(f"{w}.group_id", self.group_id, MAX_NAME_LEN))
        _set(self, "prompt_ids", _ints(f"{w}.prompt_ids", self.prompt_ids, MAX_PROMPT_TOKENS, 0, MAX_VOCAB - 1, min_len=1))
        _set(self, "episodes", _nested_seq(f"{w}.episodes", self.episodes, Episode, MAX_GROUP_SIZE, min_len=1))

    @property
    def min_version(self) -> int:
        return min(e.first_version for e in self.episodes)

    @property
    def max_version(self) -> int:
        return max(e.max_version for e in self.episodes)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.episodes)

    @property
    def num_rollouts(self) -> int:
        """What the learner's ledger counts of the group: its episodes (one rollout each)."""
        return len(self.episodes)


@dataclass(frozen=True, kw_only=True, slots=True)
class EpisodeBatch(WireMessage):
    """The episode groups of one generation batch; one gossip message, signed by its publisher."""

    KIND: ClassVar[str | None] = "episode_batch"
    SIGNER_FIELD: ClassVar[str | None] = "peer_id"
    _NESTED_TUPLE: ClassVar[Mapping[str, tuple[type[WireMessage], int]]] = {"groups": (EpisodeGroup, MAX_BATCH_GROUPS)}

    run_id: str
    peer_id: str
    seq: int
    groups: tuple[EpisodeGroup, ...]

    def __post_init__(self) -> None:
        w = "EpisodeBatch"
        _set(self, "run_id", _run_id(f"{w}.run_id", self.run_id))
        _set(self, "peer_id", _peer_id(f"{w}.peer_id", self.peer_id))
        _set(self, "seq", _int(f"{w}.seq", self.seq, 0, MAX_SEQ))
        _set(self, "groups", _nested_seq(f"{w}.groups", self.groups, EpisodeGroup, MAX_BATCH_GROUPS, min_len=1))

    @property
    def max_version(self) -> int:
        return max(g.max_version for g in self.groups)

    @property
    def num_samples(self) -> int:
        """Rollouts in the batch, as `RolloutBatch.num_samples` counts them: its episodes."""
        return sum(len(g.episodes) for g in self.groups)


@dataclass(frozen=True, kw_only=True, slots=True)
class Budgets:
    """A run's episode budgets: model turns, tokens of one model turn, tokens of all turns."""

    max_turns: int
    turn_tokens: int
    episode_tokens: int

    def __post_init__(self) -> None:
        w = "Budgets"
        _int(f"{w}.max_turns", self.max_turns, 1, (MAX_EPISODE_TURNS + 1) // 2)
        _int(f"{w}.turn_tokens", self.turn_tokens, 1, MAX_TURN_TOKENS)
        _int(f"{w}.episode_tokens", self.episode_tokens, 1, MAX_EPISODE_TOKENS)


def check_budgets(episode: Episode, budgets: Budgets) -> str | None:
    """What of `budgets` the episode exceeds (None: nothing). An honest runner stops an episode
    at the first budget it reaches, so any excess is a forgery, not an accident."""
    model = episode.model_turns
    if len(model) > budgets.max_turns:
        return f"{len(model)} model turns, above the run's {budgets.max_turns}"
    longest = max(len(t.token_ids) for t in model)
    if longest > budgets.turn_tokens:
        return f"a model turn of {longest} tokens, above the run's {budgets.turn_tokens}"
    if episode.num_tokens > budgets.episode_tokens:
        return f"{episode.num_tokens} tokens in all, above the run's {budgets.episode_tokens}"
    return None
