"""The learner's check of a peer's episodes: the runner's rules on their tokens, then, for a
deterministic environment, a re-run of the environment on the episode's actions.

1. Structure (`check_structure`, any environment): what the runner's rules
   (echo_node/envs/runner.py) give every episode, whatever the environment answers:
   - the run's budgets (turns, tokens per turn, tokens in all);
   - every model turn within the room the budgets leave it, ending at its first eos or running
     to its whole room (no engine stops early);
   - a return within the environment's declared range.
2. The re-run (deterministic environments only). Such an environment answers the same to the
   same (seed, actions) (echo_node/envs/__init__.py), so for every episode of a group the
   learner makes a fresh environment, resets it with the group's seed (the slot's draw,
   protocol/assignment.py), and feeds it the text of each model turn. It then holds the peer to
   what the environment says:
   - the first observation renders to the group's `prompt_ids`;
   - every environment turn is, token for token, the rendered answer to the model turn before
     it (a fabricated observation, e.g. a tool result the model "wished for", differs);
   - the episode ends where the runner ends it: when the environment says done, or where the
     budgets end it; neither earlier (dropping turns that went badly) nor later;
   - the claimed return equals the sum of the environment's rewards.
   Every episode of every group is re-run at once, turn by turn as the runner plays them (one
   bounded call per turn for all of them), so the re-run takes at most (1 + max_turns) times
   `step_timeout_s`, and an environment's latency is paid once per turn, not per episode.

A failure of 1 or 2 is `bad_episode` for the group's publisher (a ban, like a forged reward).
The environment's own failure during the re-run (it raised, overran its time, or found no free
thread: env_error, env_timeout, env_unavailable) is not the peer's fault: the group is dropped
with that reason and nobody is blamed.

An untrusted-only environment (`deterministic = False`, admitted only with `net.allow_peers`)
cannot be re-run: the same actions may get other answers, so a difference would prove nothing.
Its episodes get check 1 only. Their first observation, every environment turn, where each
episode ended and the return (within the range) are taken as the allowlisted peer sent them:
nothing the learner cannot judge is held against anyone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from echo_node.envs import Env, EnvError, EnvSpec, Step
from echo_node.envs.bounded import Outcome, call_bounded, reason_of
from echo_node.envs.format import EpisodeFormat
from echo_node.envs.runner import _checked_step, _made_and_reset, next_room
from protocol.episodes import Episode, EpisodeGroup, check_budgets

# A claimed return may differ from the re-run's by this much (relative to 1 or its size): sums
# of the same floats in the same order are equal; this only forgives an environment whose
# arithmetic rounds differently across machines.
REWARD_TOLERANCE = 1e-6


@dataclass(frozen=True, slots=True)
class Verdict:
    """`bad`: why the group is a forgery (`bad_episode`); `env_failed`: the re-run itself failed
    (env_error / env_timeout / env_unavailable, nobody's fault); both None: every episode checks out."""

    bad: str | None = None
    env_failed: str | None = None

    @property
    def ok(self) -> bool:
        return self.bad is None and self.env_failed is None


def check_structure(spec: EnvSpec, fmt: EpisodeFormat, episode: Episode) -> str | None:
    """Check 1 of the module docstring: why the episode breaks the runner's rules (None: it keeps them)."""
    over = check_budgets(episode, spec.budgets)
    if over is not None:
        return over
    used, turns = 0, episode.turns
    for j in range(0, len(turns), 2):
        ids = turns[j].token_ids
        room = next_room(used, j // 2, spec)
        if len(ids) > room:
            return f"model turn {j // 2} has {len(ids)} tokens where {room} were left"
        if fmt.eos_id in ids[:-1]:
            return f"model turn {j // 2} goes on after its eos"
        if ids[-1] != fmt.eos_id and len(ids) != room:
            return f"model turn {j // 2} stops after {len(ids)} of {room} tokens without an eos"
        used += len(ids) + (len(turns[j + 1].token_ids) if j + 1 < len(turns) else 0)
    low, high = spec.reward_range
    if not low - REWARD_TOLERANCE <= episode.reward <= high + REWARD_TOLERANCE:
        return f"return {episode.reward!r} outside the environment's range [{low}, {high}]"
    return None


def verify_group(spec: EnvSpec, fmt: EpisodeFormat, group: EpisodeGroup, seed: int) -> Verdict:
    """Check every episode of `group` (module docstring)."""
    return verify_groups(spec, fmt, [(group, seed)])[0]


@dataclass(slots=True)
class _Replay:
    """One episode being re-run: `j` indexes its next model turn, `used` its tokens so far."""

    group: EpisodeGroup
    episode: Episode
    seed: int
    verdict: Verdict | None = None  # decided (None: still being re-run, or it kept every rule)
    env: Env | None = None
    j: int = 0
    used: int = 0
    total: float = 0.0
    ended: bool = False


def verify_groups(
    spec: EnvSpec, fmt: EpisodeFormat, groups: list[tuple[EpisodeGroup, int]], *, owner: str | None = None
) -> list[Verdict]:
    """`verify_group` of each (group, seed), every episode of every group re-run at once; calls
    of the environment left hung are charged to `owner` (echo_node/envs/bounded.py). Within a
    group a forgery outweighs the environment's failure on another of its episodes."""
    replays = [_Replay(g, e, seed) for g, seed in groups for e in g.episodes]
    for r in replays:
        broken = check_structure(spec, fmt, r.episode)
        r.verdict = None if broken is None else Verdict(bad=broken)
    if spec.deterministic:
        _rerun(spec, fmt, [r for r in replays if r.verdict is None], owner)
    verdicts: list[Verdict] = []
    i = 0
    for g, _ in groups:
        mine = [r.verdict or Verdict() for r in replays[i : i + len(g.episodes)]]
        i += len(g.episodes)
        bad = next(((k, v.bad) for k, v in enumerate(mine) if v.bad is not None), None)
        failed = next((v for v in mine if v.env_failed is not None), None)
        verdicts.append(Verdict(bad=f"episode {bad[0]}: {bad[1]}") if bad is not None else failed or Verdict())
    return verdicts


def _rerun(spec: EnvSpec, fmt: EpisodeFormat, replays: list[_Replay], owner: str | None) -> None:
    """Check 2 on every replay at once; each replay's `verdict` is left None when it passed."""
    firsts = call_bounded([_made_and_reset(spec.factory, r.seed) for r in replays], spec.step_timeout_s, owner=owner)
    for r, first in zip(replays, firsts):
        if first.error is not None or first.value is None:
            r.verdict = Verdict(env_failed=reason_of(first.error or "env_error"))
            continue
        r.env, message = first.value
        try:
            if tuple(fmt.first_ids(message, spec.tools)) != r.group.prompt_ids:
                r.verdict = Verdict(bad="the first observation is not the one the environment gives for the group's seed")
        except EnvError:
            r.verdict = Verdict(env_failed="env_error")
    while active := [r for r in replays if r.verdict is None and not r.ended]:
        calls = [_checked_step(_env(r), fmt.action_text(r.episode.turns[r.j].token_ids)) for r in active]
        for r, out in zip(active, call_bounded(calls, spec.step_timeout_s, owner=owner)):
            r.verdict = _answered(spec, fmt, r, out)
    for r in replays:
        if r.verdict is None and not math.isclose(r.total, r.episode.reward, rel_tol=REWARD_TOLERANCE, abs_tol=REWARD_TOLERANCE):
            r.verdict = Verdict(bad=f"claimed return {r.episode.reward!r}, the environment gives {r.total!r}")


def _env(r: _Replay) -> Env:
    assert r.env is not None, "a replay steps only once its environment was made"
    return r.env


def _answered(spec: EnvSpec, fmt: EpisodeFormat, r: _Replay, out: Outcome[Step]) -> Verdict | None:
    """The environment's answer to model turn `r.j` against the episode's next turn: a verdict,
    or None to go on (`r.ended` once the environment or the budgets end the episode there)."""
    if out.error is not None or out.value is None:
        return Verdict(env_failed=reason_of(out.error or "env_error"))
    turns, j = r.episode.turns, r.j
    ids = turns[j].token_ids
    r.used += len(ids)
    step = out.value
    r.total += step.reward
    last = j == len(turns) - 1
    if step.done:
        if not last:
            return Verdict(bad=f"the episode goes on after the environment ended it (model turn {j // 2})")
        r.ended = True
        return None
    try:
        expected = fmt.next_ids(step.observation, after_eos=ids[-1] == fmt.eos_id)  # type: ignore[arg-type]
    except EnvError:
        return Verdict(env_failed="env_error")
    fits = bool(expected) and next_room(r.used + len(expected), j // 2 + 1, spec) > 0
    if last:
        if fits:
            return Verdict(bad=f"the episode ends after model turn {j // 2}, before the environment or the budgets end it")
        r.ended = True
        return None
    if not fits:
        return Verdict(bad=f"an environment turn after model turn {j // 2}, where the runner ends the episode")
    if turns[j + 1].token_ids != tuple(expected):
        return Verdict(bad=f"environment turn {j // 2} is not what the environment answers (fabricated observation)")
    r.used += len(expected)
    r.j += 2
    return None
