"""A rollout peer's episode batch: the groups its slots assign, played and sealed.

The seeds are the slots' draws (protocol/assignment.py): group i of the batch published under
`seq` plays the environment from seed prompt_draw(run, peer, seq, i), whatever version it
begins on. The learner recomputes them from the batch, so a peer cannot choose easy
seeds. Since a group's seed follows from its position, a batch carries the groups before the
first one that was dropped (an environment failure): the later ones are dropped with it, under
the same reason, instead of moving up into slots that are not theirs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from echo_node.envs import EnvSpec
from echo_node.envs.format import EpisodeFormat
from echo_node.envs.runner import run_groups
from protocol.assignment import batch_seed, prompt_draw
from protocol.envelope import seal
from protocol.episodes import EpisodeBatch, EpisodeGroup
from protocol.identity import Identity

if TYPE_CHECKING:
    from echo_node.ml.engine import Engine, SwapHook


@dataclass(slots=True)
class PlayedBatch:
    """`frame`: the sealed batch (None when no group survived); `dropped`: groups by reason."""

    frame: bytes | None
    batch: EpisodeBatch | None
    dropped: Counter[str]


def play_batch(
    engine: Engine,
    fmt: EpisodeFormat,
    spec: EnvSpec,
    *,
    run_id: str,
    identity: Identity,
    seq: int,
    groups: int,
    group_size: int,
    temperature: float,
    top_p: float = 1.0,
    swap: SwapHook | None = None,
) -> PlayedBatch:
    peer = identity.peer_id
    seeds = [prompt_draw(run_id, peer, seq, i) for i in range(groups)]
    tag = f"{peer[-8:]}-{seq}"
    result = run_groups(
        engine, fmt, spec, seeds, group_size=group_size, temperature=temperature, top_p=top_p,
        seed=batch_seed(run_id, peer, seq), swap=swap, group_ids=[f"{tag}.{i}" for i in range(groups)],
    )
    dropped = Counter(result.dropped)
    kept: list[EpisodeGroup] = []
    for g in result.groups:
        if g is None:
            break
        kept.append(g)
    after = [g for g in result.groups[len(kept) + 1:] if g is not None]
    if after:
        # Groups played fine but after a dropped one: counted under the first drop's reason.
        first = next(iter(result.dropped))
        dropped[first] += len(after)
    if not kept:
        return PlayedBatch(None, None, dropped)
    batch = EpisodeBatch(run_id=run_id, peer_id=peer, seq=seq, groups=tuple(kept))
    return PlayedBatch(seal(batch, identity), batch, dropped)
