"""Episodes on the wire (protocol/episodes.py): round trips, and hostile input refused by name."""

from __future__ import annotations

import math
from typing import Any

import pytest

from protocol._wire import pack, unpack_strict
from protocol.envelope import open_envelope, seal
from protocol.episodes import (
    MAX_EPISODE_TOKENS,
    MAX_EPISODE_TURNS,
    Budgets,
    Episode,
    EpisodeBatch,
    EpisodeGroup,
    Turn,
    check_budgets,
)
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.identity import Identity
from protocol.messages import MESSAGE_TYPES, decode_message, encode_message


def model(ids: list[int], version: int = 3) -> Turn:
    return Turn(from_env=False, token_ids=tuple(ids), logprobs=tuple(-0.5 for _ in ids), versions=tuple(version for _ in ids))


def env(ids: list[int]) -> Turn:
    return Turn(from_env=True, token_ids=tuple(ids), logprobs=(), versions=())


def episode(reward: float = 0.5) -> Episode:
    return Episode(turns=(model([5, 6, 2], 3), env([7, 8]), model([9, 2], 4)), reward=reward)


def batch(identity: Identity) -> EpisodeBatch:
    group = EpisodeGroup(group_id="g0", prompt_ids=(1, 4, 5), episodes=(episode(0.5), episode(0.0)))
    return EpisodeBatch(run_id="r", peer_id=identity.peer_id, seq=7, groups=(group,))


def test_round_trip_sealed_and_unsealed() -> None:
    ident = Identity.generate()
    b = batch(ident)
    assert EpisodeBatch.from_wire(unpack_strict(pack(b.to_wire()), what="t")) == b
    assert MESSAGE_TYPES["episode_batch"] is EpisodeBatch
    assert decode_message(encode_message(b), EpisodeBatch) == b
    opened, sender = open_envelope(seal(b, ident), expected_kind=EpisodeBatch, expected_sender=ident.peer_id)
    assert opened == b and sender == ident.peer_id
    g = b.groups[0]
    assert (g.min_version, g.max_version, g.num_tokens) == (3, 4, 14)
    assert g.episodes[0].model_turns == (g.episodes[0].turns[0], g.episodes[0].turns[2])


def _wire_episode(turns: list[list[Any]], reward: float = 0.5) -> list[Any]:
    return [turns, reward]


def _from(turns: list[list[Any]], reward: float = 0.5) -> Episode:
    return Episode.from_wire(_wire_episode(turns, reward))


GOOD_MODEL = [False, [5, 2], [-0.5, -0.5], [3, 3]]
GOOD_ENV = [True, [7], [], []]


@pytest.mark.parametrize(
    ("turns", "names"),
    [
        # masks that do not match: an environment turn with log-probs or versions (it would enter the loss)
        ([GOOD_MODEL, [True, [7], [-0.1], []], GOOD_MODEL], "Turn.logprobs"),
        ([GOOD_MODEL, [True, [7], [], [3]], GOOD_MODEL], "Turn.versions"),
        # a model turn whose log-probs or versions do not cover its tokens
        ([[False, [5, 2], [-0.5], [3, 3]]], "Turn.logprobs"),
        ([[False, [5, 2], [-0.5, -0.5], [3]]], "Turn.versions"),
        # roles out of order, or an episode that ends on the environment's turn
        ([GOOD_MODEL, GOOD_MODEL], "turns alternate"),
        ([GOOD_ENV], "turns alternate"),
        ([GOOD_MODEL, GOOD_ENV], "ends with a model turn"),
        # forged per-turn versions: backwards inside a turn, or across turns
        ([[False, [5, 2], [-0.5, -0.5], [4, 3]]], "non-decreasing"),
        ([[False, [5, 2], [-0.5, -0.5], [9, 9]], GOOD_ENV, GOOD_MODEL], "before the previous turn"),
        # empty turns, bad values
        ([[False, [], [], []]], "Turn.token_ids"),
        ([[False, [5], [0.5], [3]]], "Turn.logprobs[0]"),
        ([[False, [5], [math.nan], [3]]], "Turn.logprobs[0]"),
        ([[False, [5], [-0.5], [-1]]], "Turn.versions[0]"),
        ([[1, [5], [-0.5], [3]]], "Turn.from_env"),
        ([[False, [True], [-0.5], [3]]], "Turn.token_ids[0]"),
    ],
)
def test_malformed_episodes_are_refused_by_name(turns: list[list[Any]], names: str) -> None:
    with pytest.raises(RemoteProtocolError, match="Episode") as info:
        _from(turns)
    assert names in str(info.value)


def test_episodes_longer_than_the_wire_bounds() -> None:
    # Too many turns: refused before any turn is built (the nested list's own bound).
    turns = [GOOD_MODEL if i % 2 == 0 else GOOD_ENV for i in range(MAX_EPISODE_TURNS + 2)]
    with pytest.raises(RemoteProtocolError, match="at most"):
        _from(turns)
    # Each turn within its bound, too many tokens together.
    big = 1500
    turns = [[False, [5] * big, [-0.5] * big, [3] * big], [True, [7] * big, [], []], [False, [5] * big, [-0.5] * big, [3] * big]]
    with pytest.raises(RemoteProtocolError, match=f"above {MAX_EPISODE_TOKENS}"):
        _from(turns)
    with pytest.raises(RemoteProtocolError, match="reward"):
        _from([GOOD_MODEL], reward=math.inf)
    with pytest.raises(RemoteProtocolError, match="expected 2 fields"):
        Episode.from_wire([[GOOD_MODEL], 0.5, "extra"])


def test_run_budgets_are_checked_separately() -> None:
    e = episode()
    assert check_budgets(e, Budgets(max_turns=2, turn_tokens=3, episode_tokens=7)) is None
    assert "model turns" in str(check_budgets(e, Budgets(max_turns=1, turn_tokens=3, episode_tokens=7)))
    assert "model turn of 3" in str(check_budgets(e, Budgets(max_turns=2, turn_tokens=2, episode_tokens=7)))
    assert "7 tokens in all" in str(check_budgets(e, Budgets(max_turns=2, turn_tokens=3, episode_tokens=6)))
    with pytest.raises(LocalProtocolError):
        Budgets(max_turns=0, turn_tokens=1, episode_tokens=1)


def test_a_batch_needs_a_group_and_a_group_an_episode() -> None:
    ident = Identity.generate()
    with pytest.raises(LocalProtocolError, match="EpisodeBatch.groups"):
        EpisodeBatch(run_id="r", peer_id=ident.peer_id, seq=0, groups=())
    with pytest.raises(LocalProtocolError, match="EpisodeGroup.episodes"):
        EpisodeGroup(group_id="g", prompt_ids=(1,), episodes=())
    # A signed batch names its publisher: one signed by another identity is refused.
    other = Identity.generate()
    with pytest.raises(RemoteProtocolError):
        open_envelope(seal(batch(ident), ident), expected_kind=EpisodeBatch, expected_sender=other.peer_id)
