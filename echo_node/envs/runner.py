"""Multi-turn rollouts on a peer: the engine acts, the environment answers, turn after turn.

`run_groups` plays `group_size` episodes for each seed (GRPO's group: episodes of one
(environment, seed)), all active episodes of all groups batched into one engine call per turn:

1. Each episode gets its own environment instance (made in the bounded call, its constructor
   being the plug-in's code too); `reset(seed)` gives the first observation, rendered by the
   run's format (echo_node/envs/format.py) into the group's prompt ids. A deterministic
   environment's resets of one seed agree (else it is failing: env_error). An untrusted-only
   one's may not: the group's other episodes then play copies (`copy.deepcopy`) of its first
   episode's environment, made right after its reset, so a group is always episodes of one
   start; one that cannot be copied loses the group (env_error).
2. A turn: the engine continues every active episode's tokens so far (first observation and
   all turns), up to the turn budget and what the episode budget has left. The engine re-runs
   the prefill on each call; a weight swap between or inside turns goes through its `swap` hook,
   so every token carries the version that sampled it and later turns carry the new version.
3. The environment steps on the turn's text (`format.action_text`), every active episode's step
   at once in worker threads, bounded by `step_timeout_s`. Its answer is rendered and appended
   as an environment turn (masked out of the loss by the learner).
4. An episode ends when the environment says done, after `max_turns` model turns, or when the
   next answer renders to no tokens, would not fit the episode budget, or would leave no room
   for one more model token (the answer is then left out: an episode ends with a model turn).

An environment that raises, answers malformed, or overruns its time fails its episode, and the
episode's group is dropped, counted by reason (`env_error`, `env_timeout`); nothing propagates
to the caller. A thread stuck in a hung call cannot be killed: it stays hung, and while hung
ones take every place (echo_node/envs/bounded.py) a group's calls do not start and the group is
dropped as `env_unavailable` at once, so a hung environment costs bounded threads, never the
peer (which backs off: echo_node/peer/rollout_peer.py).

The learner's re-run (echo_node/envs/verify.py) applies the same rules to the same tokens.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from echo_node.envs import Env, EnvError, EnvSpec, Message, Step, check_message, check_step
from echo_node.envs.bounded import Outcome, call_bounded, reason_of
from echo_node.envs.format import EpisodeFormat
from protocol.episodes import Episode, EpisodeGroup, Turn
from protocol.errors import LocalProtocolError

if TYPE_CHECKING:
    from echo_node.ml.engine import Engine, SwapHook

__all__ = ["RunResult", "next_room", "run_groups"]


@dataclass(slots=True)
class _Episode:
    env: Env | None = None
    turns: list[Turn] = field(default_factory=list)
    used: int = 0
    reward: float = 0.0
    model_turns: int = 0
    over: bool = False
    failed: str | None = None


@dataclass(slots=True)
class RunResult:
    """The groups played (None where a group was dropped), and the drops by reason."""

    groups: list[EpisodeGroup | None]
    dropped: Counter[str]


def _made_and_reset(factory: Callable[[], Env], seed: int) -> Callable[[], tuple[Env, Message]]:
    def call() -> tuple[Env, Message]:
        env = factory()
        return env, check_message(env.reset(seed))

    return call


def _copied(env: Env) -> Callable[[], Env]:
    return lambda: copy.deepcopy(env)


def _checked_step(env: Env, action: str) -> Callable[[], Step]:
    return lambda: check_step(env.step(action))


def _env(e: _Episode) -> Env:
    assert e.env is not None, "an episode steps only once its environment was made"
    return e.env


def _start_group(spec: EnvSpec, fmt: EpisodeFormat, group: list[_Episode], outs: list[Outcome[tuple[Env, Message]]]) -> list[int] | None:
    """The group's prompt ids, each episode's environment set (step 1 of the module docstring);
    None when the group fails, each episode's `failed` saying why."""

    def fail(why: str) -> None:
        for e in group:
            e.failed = why

    made: list[tuple[Env, Message]] = []
    for o in outs:
        if o.error is not None or o.value is None:
            fail(o.error or "env_error: no answer")
            return None
        made.append(o.value)
    first = made[0][1]
    if any(m != first for _, m in made):
        if spec.deterministic:
            fail("env_error: reset(seed) answered differently for one seed")
            return None
        copies = call_bounded([_copied(made[0][0]) for _ in made[1:]], spec.step_timeout_s)
        failed = next((c.error or "env_error: no copy" for c in copies if c.error is not None or c.value is None), None)
        if failed is not None:
            fail(failed)
            return None
        made = [made[0], *((c.value, first) for c in copies if c.value is not None)]
    for e, (env, _) in zip(group, made):
        e.env = env
    try:
        return fmt.first_ids(first, spec.tools)
    except EnvError as exc:
        fail(f"env_error: {exc}")
        return None


def next_room(used: int, model_turns: int, spec: EnvSpec) -> int:
    """Tokens the next model turn may take (0: the episode is over by its budgets)."""
    b = spec.budgets
    if model_turns >= b.max_turns:
        return 0
    return max(0, min(b.turn_tokens, b.episode_tokens - used))


def run_groups(
    engine: Engine,
    fmt: EpisodeFormat,
    spec: EnvSpec,
    seeds: Sequence[int],
    *,
    group_size: int,
    temperature: float,
    top_p: float = 1.0,
    seed: int | None = None,
    swap: SwapHook | None = None,
    group_ids: Sequence[str] | None = None,
) -> RunResult:
    """Play `group_size` episodes per seed (module docstring); never raises for what an
    environment does."""
    dropped: Counter[str] = Counter()
    episodes = [[_Episode() for _ in range(group_size)] for _ in seeds]
    flat = [e for g in episodes for e in g]
    firsts = call_bounded([_made_and_reset(spec.factory, s) for s in seeds for _ in range(group_size)], spec.step_timeout_s)
    prompts: list[list[int] | None] = []
    for k, g in enumerate(episodes):
        prompts.append(_start_group(spec, fmt, g, firsts[k * group_size : (k + 1) * group_size]))
    prompt_of = [prompts[k] for k, g in enumerate(episodes) for _ in g]
    turn = 0
    while True:
        active = [i for i, e in enumerate(flat) if not e.over and e.failed is None]
        rooms = {i: next_room(flat[i].used, flat[i].model_turns, spec) for i in active}
        for i in active:
            if rooms[i] == 0:
                flat[i].over = True
        active = [i for i in active if rooms[i] > 0]
        if not active:
            break
        contexts = [list(prompt_of[i] or ()) + [t for turn_ in flat[i].turns for t in turn_.token_ids] for i in active]
        gens = engine.generate(
            contexts, max_new_tokens=max(rooms[i] for i in active), temperature=temperature, top_p=top_p,
            seed=None if seed is None else seed + turn, swap=swap,
        )
        turn += 1
        actions: list[str] = []
        for i, gen in zip(active, gens):
            e, n = flat[i], rooms[i]
            ids, lps, vs = gen.completion_ids[:n], gen.logprobs[:n], gen.token_versions[:n]
            if not ids:  # an engine always samples one token; guard the wire's min length
                e.failed = "env_error: the engine returned an empty turn"
                actions.append("")
                continue
            e.turns.append(Turn(from_env=False, token_ids=tuple(ids), logprobs=tuple(lps), versions=tuple(vs)))
            e.used += len(ids)
            e.model_turns += 1
            actions.append(fmt.action_text(ids))
        stepping = [(i, a) for i, a in zip(active, actions) if flat[i].failed is None]
        answers = call_bounded([_checked_step(_env(flat[i]), a) for i, a in stepping], spec.step_timeout_s)
        for (i, _), out in zip(stepping, answers):
            e = flat[i]
            if out.error is not None or out.value is None:
                e.failed = out.error or "env_error: no answer"
                continue
            step = out.value
            e.reward += step.reward
            if step.done:
                e.over = True
                continue
            after_eos = e.turns[-1].token_ids[-1] == fmt.eos_id
            try:
                obs = fmt.next_ids(step.observation, after_eos=after_eos)  # type: ignore[arg-type]
            except EnvError as exc:
                e.failed = f"env_error: {exc}"
                continue
            if not obs or next_room(e.used + len(obs), e.model_turns, spec) == 0:
                e.over = True  # the answer does not fit, or leaves the model no room: truncated
                continue
            e.turns.append(Turn(from_env=True, token_ids=tuple(obs), logprobs=(), versions=()))
            e.used += len(obs)
    out_groups: list[EpisodeGroup | None] = []
    for k, g in enumerate(episodes):
        failed = next((e.failed for e in g if e.failed), None)
        prompt = prompts[k]
        if failed is not None or prompt is None:
            dropped[reason_of(failed or "env_error")] += 1
            out_groups.append(None)
            continue
        gid = group_ids[k] if group_ids is not None else f"s{seeds[k]}"
        try:
            eps = tuple(Episode(turns=tuple(e.turns), reward=e.reward) for e in g)
            out_groups.append(EpisodeGroup(group_id=gid, prompt_ids=tuple(prompt), episodes=eps))
        except LocalProtocolError:  # e.g. a return beyond the wire's reward bound
            dropped["env_error"] += 1
            out_groups.append(None)
    return RunResult(out_groups, dropped)
