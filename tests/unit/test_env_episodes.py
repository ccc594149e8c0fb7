"""Multi-turn episodes end to end on one machine, with the real pieces: the embedded model in a
TorchEngine plays the calculator environment (echo_node/envs/runner.py), the batch travels
sealed as the wire form, the learner re-runs the environment on it (echo_node/envs/verify.py)
and trains on it with environment tokens masked out (echo_node/envs/train.py).

Hostile cases: fabricated observations, returns the re-run does not give, episodes cut short or
run past their end or their budgets, an environment that raises, hangs or answers malformed."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from echo_node.config import load_config
from echo_node.envs import EnvSpec, load_env
from echo_node.envs.format import CharFormat
from echo_node.envs.runner import RunResult, run_groups
from echo_node.envs.train import train_group
from echo_node.envs.verify import verify_group
from echo_node.ml import defaults
from echo_node.ml.engine import Generation, TorchEngine
from echo_node.ml.grpo import PolicyOptimizer
from echo_node.ml.model import build_model, state_to_bytes, tiny_llama_config
from echo_node.ml.tasks import AdditionTask
from echo_node.ml.tokenizer import CharTokenizer
from echo_node.ml.warmup import warmup
from protocol.envelope import open_envelope, seal
from protocol.episodes import Episode, EpisodeBatch, EpisodeGroup, Turn
from protocol.identity import Identity
from tests.unit import env_plugins

torch.set_num_threads(1)
TOK = CharTokenizer()
FMT = CharFormat(TOK)
SEEDS = [11, 12, 13]
G = 4


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m = build_model(tiny_llama_config(TOK.vocab_size), seed=0)
    warmup(m, TOK, AdditionTask(), config=defaults.WARMUP, cache_dir=Path.home() / ".cache" / "echo-node")
    return m


def calc(**env: object) -> EnvSpec:
    return load_env(load_config(None, env__name="calc", **{f"env__{k}": v for k, v in env.items()}))


def play(model: torch.nn.Module, spec: EnvSpec, engine: object | None = None, seeds: list[int] = SEEDS) -> RunResult:
    eng = engine or TorchEngine(model, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
    return run_groups(eng, FMT, spec, seeds, group_size=G, temperature=1.0, seed=5)  # type: ignore[arg-type]


def test_episodes_play_verify_and_train_with_env_tokens_masked(model: torch.nn.Module) -> None:
    spec = calc(options={"problems": 2})
    result = play(model, spec)
    assert not result.dropped and all(g is not None for g in result.groups)
    groups = [g for g in result.groups if g is not None]
    ident = Identity.generate()
    # Over the wire: sealed, opened, equal.
    sent = EpisodeBatch(run_id="r", peer_id=ident.peer_id, seq=0, groups=tuple(groups))
    got, _ = open_envelope(seal(sent, ident), expected_kind=EpisodeBatch, expected_sender=ident.peer_id)
    assert got == sent
    multi = 0
    for seed, group in zip(SEEDS, got.groups):
        assert verify_group(spec, FMT, group, seed).ok
        for e in group.episodes:
            assert len(e.model_turns) <= spec.budgets.max_turns and e.num_tokens <= spec.budgets.episode_tokens
            multi += len(e.model_turns) > 1
            assert 0.0 <= e.reward <= 1.0
    assert multi > 0  # the environment answered and the model acted again
    # The warmed-up model answers some problems right: returns differ within groups.
    assert any(len({e.reward for e in g.episodes}) > 1 for g in got.groups)
    # Training: only model tokens count, and the environment's tokens get no gradient.
    learner = copy.deepcopy(model)
    opt = PolicyOptimizer(learner, lr=1e-3, pad_id=TOK.pad_id)
    tgs = [train_group(g) for g in got.groups]
    stats = opt.step(tgs)
    used = [g for g in tgs if len(set(g.rewards)) > 1]
    model_tokens = sum(sum(m) for g in used for m in g.loss_masks or [])
    all_tokens = sum(len(c) for g in used for c in g.completions)
    assert stats["groups_used"] == len(used) and stats["tokens"] == model_tokens < all_tokens
    # On-policy: the learner's recomputation of the model tokens is the engine's (weights ~1).
    assert stats["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_environment_tokens_do_not_move_the_policy() -> None:
    """Appending masked environment tokens to every episode changes no gradient: they are
    context only (nothing after them here) and out of the loss, the weights and the mean."""
    m = build_model(tiny_llama_config(TOK.vocab_size), seed=3)
    group = EpisodeGroup(group_id="g", prompt_ids=(1, 4, 5), episodes=tuple(
        Episode(turns=(Turn(from_env=False, token_ids=(t, 2), logprobs=(-1.0, -1.0), versions=(0, 0)),), reward=r)
        for t, r in ((5, 1.0), (6, 0.0))
    ))
    plain = train_group(group)
    padded = dataclasses.replace(
        plain, completions=[c + [9, 9] for c in plain.completions],
        behaviour_logprobs=[lp + [0.0, 0.0] for lp in plain.behaviour_logprobs], loss_masks=[[True, True, False, False]] * 2,
    )
    updates = []
    for tg in (plain, padded):
        model = copy.deepcopy(m)
        opt = PolicyOptimizer(model, lr=1.0, pad_id=TOK.pad_id, max_grad_norm=1e9)
        opt.opt = torch.optim.SGD(opt.params, lr=1.0)  # the update is minus the gradient
        before = [p.detach().clone() for p in model.parameters()]
        stats = opt.step([tg])
        updates.append([p.detach() - b for p, b in zip(model.parameters(), before)])
        assert stats["tokens"] == 4.0
    for x, y in zip(*updates):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


class SwapBetweenTurns:
    """An engine that installs new weights before its second call, as a peer between engine
    calls does, and optionally inside the first call through the swap hook."""

    def __init__(self, inner: TorchEngine, state: bytes, *, inside: bool) -> None:
        self.inner, self.state, self.inside, self.calls = inner, state, inside, 0

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, prompts: list[list[int]], **kw: object) -> list[Generation]:
        self.calls += 1
        if self.calls == 2 and not self.inside:
            self.inner.load_weights(self.state, 1)
        if self.calls == 1 and self.inside:
            steps = [0]

            def hook() -> tuple[bytes, int] | None:
                steps[0] += 1
                return (self.state, 1) if steps[0] == 2 else None

            kw["swap"] = hook
        return self.inner.generate(prompts, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("inside", [False, True])
def test_a_weight_swap_mid_episode_continues_on_new_weights_tagged(model: torch.nn.Module, inside: bool) -> None:
    spec = calc(options={"problems": 3}, turn_tokens=4)
    own = copy.deepcopy(model)
    newer = copy.deepcopy(model)
    with torch.no_grad():
        for p in newer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    engine = SwapBetweenTurns(TorchEngine(own, eos_id=TOK.eos_id, pad_id=TOK.pad_id), state_to_bytes(newer), inside=inside)
    result = play(own, spec, engine)
    groups = [g for g in result.groups if g is not None]
    assert len(groups) == len(SEEDS)
    spanning = 0
    for seed, g in zip(SEEDS, groups):
        assert verify_group(spec, FMT, g, seed).ok
        for e in g.episodes:
            versions = [v for t in e.model_turns for v in t.versions]
            assert versions == sorted(versions)
            first_turn = e.model_turns[0].versions
            if len(e.model_turns) > 1:
                spanning += 1
                # Between turns: the whole second turn is new. Inside: the first turn already moved.
                assert set(e.model_turns[1].versions) == {1}
                assert first_turn[0] == 0
                if inside:
                    assert 1 in first_turn or len(first_turn) < 3
                else:
                    assert set(first_turn) == {0}
    assert spanning > 0
    # The learner trains the episodes at the version it has; every model token is weighted.
    opt = PolicyOptimizer(copy.deepcopy(newer), lr=1e-3, pad_id=TOK.pad_id)
    stats = opt.step([train_group(g) for g in groups])
    assert stats["groups"] == len(groups)


# --- hostile: what a lying peer can send ------------------------------------------------------


@pytest.fixture(scope="module")
def honest(model: torch.nn.Module) -> tuple[EnvSpec, EpisodeGroup, int]:
    spec = calc(options={"problems": 3}, turn_tokens=8)
    for seed in range(40, 60):
        result = play(model, spec, seeds=[seed])
        g = result.groups[0]
        # A group where some episode has an environment turn to forge.
        if g is not None and any(len(e.turns) >= 3 for e in g.episodes):
            return spec, g, seed
    raise AssertionError("no multi-turn episode in 20 seeds")


def _with_episode(g: EpisodeGroup, k: int, episode: Episode) -> EpisodeGroup:
    eps = list(g.episodes)
    eps[k] = episode
    return dataclasses.replace(g, episodes=tuple(eps))


def _multi(g: EpisodeGroup) -> int:
    return next(k for k, e in enumerate(g.episodes) if len(e.turns) >= 3)


def _forge_observation(e: Episode) -> Episode:
    turns = list(e.turns)
    obs = turns[1]
    # The tool answered with the sum the model "wished for": other digits, same length.
    ids = tuple(3 + (t - 3 + 1) % 10 if 3 <= t <= 12 else t for t in obs.token_ids)
    turns[1] = dataclasses.replace(obs, token_ids=ids)
    return Episode(turns=tuple(turns), reward=e.reward)


FORGERIES: dict[str, Callable[[Episode], Episode]] = {
    "fabricated observation": _forge_observation,
    "claimed return": lambda e: Episode(turns=e.turns, reward=1.0 if e.reward < 1.0 else 0.0),
    "ends after model turn": lambda e: Episode(turns=e.turns[:1], reward=e.reward),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forged_episodes_are_bad_episode(honest: tuple[EnvSpec, EpisodeGroup, int], forgery: str) -> None:
    spec, g, seed = honest
    k = _multi(g)
    verdict = verify_group(spec, FMT, _with_episode(g, k, FORGERIES[forgery](g.episodes[k])), seed)
    assert verdict.bad is not None and verdict.env_failed is None
    assert f"episode {k}" in verdict.bad


def test_other_forgeries_are_bad_episode(honest: tuple[EnvSpec, EpisodeGroup, int]) -> None:
    spec, g, seed = honest
    k = _multi(g)
    e = g.episodes[k]
    # Another seed's first observation (the peer chose its problems).
    assert "first observation" in str(verify_group(spec, FMT, g, seed + 1000).bad)
    # Going on after the environment ended the episode: a done episode with one more exchange.
    done = next((x for x in g.episodes if x.turns[-1].token_ids[-1] == TOK.eos_id), e)
    longer = Episode(turns=done.turns + (Turn(from_env=True, token_ids=(4,), logprobs=(), versions=()), done.turns[0]), reward=done.reward)
    if len(longer.model_turns) <= spec.budgets.max_turns:
        assert verify_group(spec, FMT, _with_episode(g, 0, longer), seed).bad is not None
    # Past the run's budgets (the wire allows far more).
    tight = dataclasses.replace(spec, budgets=dataclasses.replace(spec.budgets, max_turns=1))
    assert "model turns" in str(verify_group(tight, FMT, g, seed).bad)
    # Tokens after a model turn's eos, and a turn stopped early without one.
    m = e.turns[0]
    after = dataclasses.replace(m, token_ids=(TOK.eos_id,) + m.token_ids[1:]) if len(m.token_ids) > 1 else None
    if after is not None:
        assert verify_group(spec, FMT, _with_episode(g, k, Episode(turns=(after,) + e.turns[1:], reward=e.reward)), seed).bad
    short = Turn(from_env=False, token_ids=(5,), logprobs=(-0.1,), versions=(m.versions[0],))
    assert "without an eos" in str(verify_group(spec, FMT, _with_episode(g, k, Episode(turns=(short,), reward=e.reward)), seed).bad)


# --- hostile: environments that fail on the peer ----------------------------------------------


def plugin(name: str, timeout: float = 0.2) -> EnvSpec:
    spec = load_env(load_config(None, env__name="tests.unit.env_plugins:Guess"))
    cls = getattr(env_plugins, name)
    return dataclasses.replace(spec, factory=lambda: cls(), step_timeout_s=timeout)


@pytest.mark.parametrize(("name", "reason"), [
    ("Raises", "env_error"), ("Malformed", "env_error"), ("Hangs", "env_timeout"), ("Flaky", "env_error"),
    ("Exits", "env_error"), ("RaisesInInit", "env_error"), ("HangsInInit", "env_timeout"),
])
def test_a_failing_environment_drops_its_groups_counted(model: torch.nn.Module, name: str, reason: str) -> None:
    """Whatever the plug-in's code does, its constructor's included (SystemExit too), ends its
    groups, counted by reason; the runner returns."""
    env_plugins.release_hung()
    env_plugins.RELEASE.clear()
    try:
        result = play(model, plugin(name), seeds=[2, 3])
    finally:
        env_plugins.release_hung()
    assert result.groups == [None, None] and result.dropped == {reason: 2}
    # The same engine goes on with an honest environment afterwards.
    ok = play(model, plugin("Guess"), seeds=[2])
    assert ok.groups[0] is not None and not ok.dropped
