"""The learner's check of a peer's episodes: re-run the environment on the episode's actions.

An environment is deterministic given (seed, actions) (echo_node/envs/__init__.py), so for every
episode of a group the learner makes a fresh environment, resets it with the group's seed (the
slot's draw, protocol/assignment.py), and feeds it the text of each model turn. It then holds the
peer to what the environment says, under the runner's rules (echo_node/envs/runner.py):

- the first observation renders to the group's `prompt_ids`;
- every environment turn is, token for token, the rendered answer to the model turn before it
  (a fabricated observation, e.g. a tool result the model "wished for", differs);
- the episode ends where the runner ends it: when the environment says done, or where the
  budgets end it; neither earlier (dropping turns that went badly) nor later;
- a model turn ends at its first eos, or runs to its whole room (no engine stops early);
- the claimed return equals the sum of the environment's rewards, and lies in its range.

Any failure is `bad_episode` for the group's publisher (a ban, like a forged reward). The
environment's own failure during the re-run (it raised, or overran its time) is not the
peer's fault: the group is dropped with that reason and nobody is blamed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from echo_node.envs import EnvSpec
from echo_node.envs.format import EpisodeFormat
from echo_node.envs.bounded import call_bounded, reason_of
from echo_node.envs.runner import _checked_reset, _checked_step, next_room
from echo_node.envs import EnvError
from protocol.episodes import Episode, EpisodeGroup, check_budgets

# A claimed return may differ from the re-run's by this much (relative to 1 or its size): sums
# of the same floats in the same order are equal; this only forgives an environment whose
# arithmetic rounds differently across machines.
REWARD_TOLERANCE = 1e-6


@dataclass(frozen=True, slots=True)
class Verdict:
    """`bad`: why the group is a forgery (`bad_episode`); `env_failed`: the re-run itself failed
    (env_error / env_timeout, nobody's fault); both None: every episode checks out."""

    bad: str | None = None
    env_failed: str | None = None

    @property
    def ok(self) -> bool:
        return self.bad is None and self.env_failed is None


def verify_group(spec: EnvSpec, fmt: EpisodeFormat, group: EpisodeGroup, seed: int) -> Verdict:
    """Re-run every episode of `group` (module docstring), all at once: an environment's latency
    (a remote tool, a sandbox) is then paid once per turn, not once per turn and episode."""
    return verify_groups(spec, fmt, [(group, seed)])[0]


def verify_groups(spec: EnvSpec, fmt: EpisodeFormat, groups: list[tuple[EpisodeGroup, int]]) -> list[Verdict]:
    """`verify_group` of each (group, seed), every episode of every group re-run concurrently,
    each in its own thread (each of its environment calls bounded as the runner bounds them)."""
    jobs = [(g, e, seed) for g, seed in groups for e in g.episodes]
    # An episode's re-run makes at most 1 + max_turns bounded calls; its thread is given that long.
    limit = spec.step_timeout_s * (spec.budgets.max_turns + 2)
    outcomes = call_bounded([functools.partial(_verify_episode, spec, fmt, g, e, seed) for g, e, seed in jobs], limit)
    verdicts: list[Verdict] = []
    i = 0
    for g, _ in groups:
        verdict = Verdict()
        for k in range(len(g.episodes)):
            out = outcomes[i]
            i += 1
            if not verdict.ok:
                continue
            if out.error is not None or out.value is None:
                verdict = Verdict(env_failed=reason_of(out.error or "env_error"))
            elif out.value.bad is not None:
                verdict = Verdict(bad=f"episode {k}: {out.value.bad}")
            elif out.value.env_failed is not None:
                verdict = out.value
        verdicts.append(verdict)
    return verdicts


def _verify_episode(spec: EnvSpec, fmt: EpisodeFormat, group: EpisodeGroup, episode: Episode, seed: int) -> Verdict:
    over = check_budgets(episode, spec.budgets)
    if over is not None:
        return Verdict(bad=over)
    env = spec.factory()
    (first,) = call_bounded([_checked_reset(env, seed)], spec.step_timeout_s)
    if first.error is not None or first.value is None:
        return Verdict(env_failed=reason_of(first.error or "env_error"))
    try:
        if tuple(fmt.first_ids(first.value)) != group.prompt_ids:
            return Verdict(bad="the first observation is not the one the environment gives for the group's seed")
    except EnvError:
        return Verdict(env_failed="env_error")
    used, total, turns = 0, 0.0, episode.turns
    for j in range(0, len(turns), 2):
        model = turns[j]
        room = next_room(used, j // 2, spec)
        ids = model.token_ids
        if len(ids) > room:
            return Verdict(bad=f"model turn {j // 2} has {len(ids)} tokens where {room} were left")
        if fmt.eos_id in ids[:-1]:
            return Verdict(bad=f"model turn {j // 2} goes on after its eos")
        if ids[-1] != fmt.eos_id and len(ids) != room:
            return Verdict(bad=f"model turn {j // 2} stops after {len(ids)} of {room} tokens without an eos")
        used += len(ids)
        (out,) = call_bounded([_checked_step(env, fmt.action_text(ids))], spec.step_timeout_s)
        if out.error is not None or out.value is None:
            return Verdict(env_failed=reason_of(out.error or "env_error"))
        step = out.value
        total += step.reward
        last = j == len(turns) - 1
        if step.done:
            if not last:
                return Verdict(bad=f"the episode goes on after the environment ended it (model turn {j // 2})")
            break
        try:
            expected = fmt.next_ids(step.observation, after_eos=ids[-1] == fmt.eos_id)  # type: ignore[arg-type]
        except EnvError:
            return Verdict(env_failed="env_error")
        fits = bool(expected) and next_room(used + len(expected), j // 2 + 1, spec) > 0
        if last:
            if fits:
                return Verdict(bad=f"the episode ends after model turn {j // 2}, before the environment or the budgets end it")
            break
        if not fits:
            return Verdict(bad=f"an environment turn after model turn {j // 2}, where the runner ends the episode")
        if turns[j + 1].token_ids != tuple(expected):
            return Verdict(bad=f"environment turn {j // 2} is not what the environment answers (fabricated observation)")
        used += len(expected)
    low, high = spec.reward_range
    if not math.isclose(total, episode.reward, rel_tol=REWARD_TOLERANCE, abs_tol=REWARD_TOLERANCE):
        return Verdict(bad=f"claimed return {episode.reward!r}, the environment gives {total!r}")
    if not low - REWARD_TOLERANCE <= episode.reward <= high + REWARD_TOLERANCE:
        return Verdict(bad=f"return {episode.reward!r} outside the environment's range [{low}, {high}]")
    return Verdict()
