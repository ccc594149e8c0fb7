"""The environment protocol (echo_node/envs): the built-in calculator environment, tool calls,
and the `[env]` registry's refusals of plug-ins that break the rules."""

from __future__ import annotations

import math

import pytest

from echo_node.config import load_config
from echo_node.envs import EnvError, Message, Step, ToolEnv, check_step, env_id, is_env_id, load_env, peer_env
from echo_node.envs.calc import CalcEnv
from protocol.episodes import Budgets
from tests.unit import env_plugins

PEER = "12D3KooWM9k9hetxMBoaPojDAuL4FsXMFGjZsttHLH67px8yCtFZ"


def test_calc_answers_tool_calls_and_scores_answers() -> None:
    env = CalcEnv(problems=2)
    first = env.reset(7)
    a, b = int(first["content"][:2]), int(first["content"][3:5])
    assert first == {"role": "user", "content": f"{a:02d}+{b:02d}="}
    call = env.step(f"{a:02d}+{b:02d}=")  # the calculator tool
    assert call.observation == {"role": "tool", "content": f"{a + b:03d}"} and call.reward == 0.0 and not call.done
    second = env.step(f"{a + b:03d}")
    assert second.reward == 0.5 and not second.done and second.observation is not None
    assert second.observation["role"] == "user"
    last = env.step("999")  # wrong (no sum of two 2-digit numbers is 999)
    assert last.done and last.reward == 0.0


def test_calc_is_deterministic_given_seed_and_actions() -> None:
    def transcript(seed: int) -> list[object]:
        env = CalcEnv(problems=3)
        out: list[object] = [env.reset(seed)]
        for action in ("000", "12+34=", "046", "x"):
            step = env.step(action)
            out.append((step.observation, step.reward, step.done))
            if step.done:
                break
        return out

    assert transcript(11) == transcript(11)
    assert transcript(11) != transcript(12)


def test_tool_calls_are_bounded_and_unknown_tools_answered_safely() -> None:
    def deep(args: object) -> str:
        raise RecursionError("the process's stack, not the arguments")

    class Search(ToolEnv):
        tools = {"echo": lambda args: str(args), "sqrt": lambda args: str(math.isqrt(args)), "deep": deep}
        max_tool_calls = 3

        def reset(self, seed: int) -> Message:
            return Message(role="user", content="q")

        def answer(self, action: str) -> Step:
            return Step(None, 1.0, True)

    env = Search()
    env.reset(0)
    ok = env.step('<tool_call>{"name": "echo", "arguments": "hi"}</tool_call>')
    assert ok.observation == {"role": "tool", "content": "hi"}
    # A call of no tool (the name is the model's text, quoted and bounded) and a broken call.
    odd = env.step('<tool_call>{"name": "' + "<|im_end|>" * 20 + '", "arguments": 1}</tool_call>')
    assert odd.observation is not None and odd.observation["content"].startswith("error: no tool named")
    assert len(odd.observation["content"]) < 80
    # Arguments the tool refuses (a str for math.isqrt, a negative int) are the model's mistake:
    # answered with the exception's type only, the same on every run, and the episode goes on.
    for args, kind in (('"x"', "TypeError"), ("-4", "ValueError")):
        bad = Search()
        bad.reset(0)
        refused = bad.step('<tool_call>{"name": "sqrt", "arguments": ' + args + '}</tool_call>')
        assert not refused.done
        assert refused.observation == {"role": "tool", "content": f"error: 'sqrt' refused its arguments ({kind})"}
    # A failure of the process's limits is not answered: it fails the episode (env_error), since
    # the learner's re-run might not meet it.
    with pytest.raises(RecursionError):
        Search().step('<tool_call>{"name": "deep", "arguments": 1}</tool_call>')
    env.step('<tool_call>{"name": "sqrt", "arguments": 16}</tool_call>')
    # The fourth call is one too many: the episode ends without reward.
    over = env.step("<tool_call>{not json}</tool_call>")
    assert over.done and over.reward == 0.0


def test_malformed_steps_are_refused() -> None:
    with pytest.raises(EnvError, match="finite"):
        check_step(Step(Message(role="user", content="x"), float("nan"), False))
    with pytest.raises(EnvError, match="role"):
        check_step(Step({"role": "system", "content": "x"}, 0.0, False))  # type: ignore[arg-type]
    with pytest.raises(EnvError, match="characters"):
        check_step(Step(Message(role="tool", content="x" * 20000), 0.0, False))
    with pytest.raises(EnvError, match="a Step"):
        check_step(("obs", 0.0, False))
    # A finished step's observation is not looked at.
    assert check_step(Step(None, 1, True)).reward == 1.0


def _cfg(name: str, **env: object) -> object:
    return load_config(None, env__name=name, **{f"env__{k}": v for k, v in env.items()})


def test_builtin_and_plugin_load_with_ids_that_pin_what_decides_episodes() -> None:
    calc = load_env(_cfg("calc"))
    assert calc.deterministic and calc.env_id.startswith("env:calc@")
    assert load_env(_cfg("calc")).env_id == calc.env_id
    assert load_env(_cfg("calc", options={"problems": 3})).env_id != calc.env_id
    assert load_env(_cfg("calc", max_turns=5)).env_id != calc.env_id
    guess = load_env(_cfg("tests.unit.env_plugins:Guess", options={"tries": 2}))
    assert guess.env_id.startswith("env:tests.unit.env_plugins.Guess@")
    # A plug-in's id hashes its module's source too: other code, another id.
    budgets = Budgets(max_turns=4, turn_tokens=8, episode_tokens=64)
    assert env_id("m:C", {}, budgets, "a") != env_id("m:C", {}, budgets, "b")
    env = guess.factory()
    assert env is not guess.factory()  # one instance per episode


@pytest.mark.parametrize(
    ("name", "options", "error"),
    [
        ("nope", {}, "neither a built-in"),
        ("no_such_module_xyz:Env", {}, "cannot import"),
        ("tests.unit.env_plugins:NOT_A_CLASS", {}, "no class"),
        ("tests.unit.env_plugins:Guess", {"colour": 1}, "do not fit"),
        ("calc", {"problems": 99}, "cannot construct"),
        ("tests.unit.env_plugins:HonestlyRandom", {}, "untrusted_only"),
        ("tests.unit.env_plugins:Dice", {}, "differently twice"),
        ("tests.unit.env_plugins:Raises", {}, "load-time probe: env_error"),
        ("tests.unit.env_plugins:Malformed", {}, "load-time probe: env_error"),
        ("tests.unit.env_plugins:Exits", {}, "load-time probe: env_error: SystemExit"),
        ("tests.unit.env_plugins:RaisesInInit", {}, "cannot construct it .*RuntimeError"),
    ],
)
def test_plugins_that_break_the_rules_are_refused_at_load(name: str, options: dict[str, object], error: str) -> None:
    with pytest.raises(EnvError, match=error):
        load_env(_cfg(name, options=options))


@pytest.mark.parametrize("name", ["Hangs", "HangsInInit"])
def test_a_plugin_that_hangs_is_refused_at_load_in_bounded_time(name: str) -> None:
    env_plugins.release_hung()
    env_plugins.RELEASE.clear()  # another test may have released the hung plug-in's threads
    try:
        with pytest.raises(EnvError, match="env_timeout"):
            load_env(_cfg(f"tests.unit.env_plugins:{name}", step_timeout_s=0.05))
    finally:
        env_plugins.release_hung()


def test_non_deterministic_env_needs_untrusted_only_and_a_private_swarm() -> None:
    with pytest.raises(ValueError, match="allow_peers"):
        _cfg("tests.unit.env_plugins:HonestlyRandom", untrusted_only=True)
    cfg = load_config(None, env__name="tests.unit.env_plugins:HonestlyRandom", env__untrusted_only=True, net__allow_peers=[PEER])
    assert load_env(cfg).deterministic is False


def test_the_readme_example_environment_loads_and_plays() -> None:
    import re
    import sys
    import types
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "class Guess" in b)
    assert len(code.splitlines()) <= 32
    module = types.ModuleType("readme_guess_env")
    exec(compile(code, "README.md", "exec"), module.__dict__)
    sys.modules["readme_guess_env"] = module
    try:
        spec = load_env(load_config(None, env__name="readme_guess_env:Guess", env__options={"tries": 3}))
    finally:
        del sys.modules["readme_guess_env"]
    env = spec.factory()
    env.reset(5)
    secret = env.secret  # type: ignore[attr-defined]
    low = env.step(str((secret + 1) % 10) if secret < 9 else "0")
    assert not low.done and low.observation is not None
    assert env.step(str(secret)) == Step(None, 1.0, True)


def test_a_joining_peer_plays_the_runs_environment_only_if_its_own_config_gives_the_same_id() -> None:
    """The run spec names the environment by id, never by code: a peer builds it from its own
    `[env]`. No table, another table, or one that does not load is refused in one line with the
    remedy; a task run has no environment."""
    run = load_env(_cfg("calc", options={"problems": 2}))
    assert peer_env("addition@0123", load_config(None)) is None and not is_env_id("addition@0123")
    assert is_env_id(run.env_id)
    got = peer_env(run.env_id, _cfg("calc", options={"problems": 2}))
    assert got is not None and got.env_id == run.env_id
    with pytest.raises(ValueError, match=r"set \[env\]"):
        peer_env(run.env_id, load_config(None))
    with pytest.raises(ValueError, match="this peer's \\[env\\] gives 'env:calc@"):
        peer_env(run.env_id, _cfg("calc", options={"problems": 3}))
    with pytest.raises(ValueError, match="does not load"):
        peer_env(run.env_id, _cfg("no_such_module_here:Env"))
