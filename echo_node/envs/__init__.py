"""Multi-turn environments: the protocol a user writes, tool calls, and the registry.

The API is Gymnasium's on chat messages:

    class MyEnv:
        deterministic = True                  # same seed and actions -> same answers
        reward_range = (0.0, 1.0)             # of an episode's return
        def reset(self, seed: int) -> Message: ...          # the first user message
        def step(self, action: str) -> Step: ...            # the model's turn, as text

A `Message` is {"role": "user" | "tool", "content": str}; `Step(observation, reward, done, info)`
gives the environment's answer (ignored when `done`), the reward of this step (an episode's
return is their sum) and whether the episode is over. A tool call is a step like any other: a
`ToolEnv` parses the model's turn, and when it is a call of one of its `tools` answers with the
tool's output as a "tool" message (reward 0, not done); anything else goes to its `answer`.
Its `tool_schemas` (the JSON schemas chat templates take, `{"type": "function", "function":
{"name", "description", "parameters"}}`) are rendered into the first observation by a chat
template that lists tools (Qwen's, Hermes', Llama 3.1's: the template says how the model is to
call them); a template without tools, and the embedded model's character format, leave them out.

Rules an environment keeps (the learner depends on them):
- Deterministic given (seed, actions): the learner re-runs the environment on a peer's actions
  and checks every answer and the return (echo_node/envs/verify.py). One instance serves one
  episode; a new episode gets a new instance. No wall clock, no global RNG, no I/O that can
  answer differently. One that cannot promise this sets `deterministic = False` and runs only
  when the operator marks it untrusted-only (`[env] untrusted_only`, a private swarm): then the
  learner does not re-run it and checks only what needs no environment (echo_node/envs/verify.py).
- Bounded: a constructor, reset or step that takes longer than `[env] step_timeout_s` ends its
  episode (its group is dropped and counted), an exception likewise; neither ends the node
  (echo_node/envs/bounded.py).

Registration mirrors `[task]`: `[env] name` is a built-in ("calc") or "module:Class" imported
from the node's own Python path, `[env.options]` its keyword arguments. A run spec carries only
the environment's id (`EnvSpec.env_id`, a hash of the name, options, budgets and, for a plug-in,
its module's source), never code: a peer builds the environment from its own config and must
arrive at the same id.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict

from echo_node.config import RunConfig
from protocol.episodes import Budgets

__all__ = [
    "ENVS",
    "Env",
    "EnvError",
    "EnvSpec",
    "Message",
    "Step",
    "ToolCall",
    "ToolEnv",
    "is_env_id",
    "load_env",
    "peer_env",
]

MAX_ENV_ID = 256
# A run spec's `task` that names an environment (`env_id`) begins so.
ENV_PREFIX = "env:"
# An observation's content is at most this many characters (an environment that answers more
# is failing: its episode ends as env_error).
MAX_CONTENT_CHARS = 16384
ROLES = ("user", "tool")
# A run's tool schemas: at most this many, this long as JSON in all (they are rendered into
# every episode's first observation), each function named so.
MAX_TOOLS = 32
MAX_TOOLS_JSON = 16384
_TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_SPEC = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


class Message(TypedDict):
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Step:
    observation: Message | None
    reward: float
    done: bool
    info: Mapping[str, Any] = field(default_factory=dict)


class Env(Protocol):
    deterministic: bool
    reward_range: tuple[float, float]

    def reset(self, seed: int) -> Message: ...

    def step(self, action: str) -> Step: ...


class EnvError(ValueError):
    """An environment broke a rule of the protocol (a malformed answer, a bad registration)."""


def check_message(obj: object) -> Message:
    """`obj` as a Message, or EnvError naming what is wrong."""
    if not isinstance(obj, Mapping) or set(obj) != {"role", "content"}:
        raise EnvError(f"an observation is {{'role', 'content'}}, got {str(obj)[:80]!r}")
    role, content = obj["role"], obj["content"]
    # Exactly str, not a subclass: the node compares and renders these outside the bounded call,
    # where a plug-in's own methods (an __eq__ that hangs) must not run.
    if type(role) is not str or role not in ROLES or type(content) is not str:
        raise EnvError(f"an observation's role is one of {ROLES} and its content a str, got a {type(role).__name__} role "
                       f"({role if type(role) is str else '?'!r:.40}) and a {type(content).__name__} content")
    if len(content) > MAX_CONTENT_CHARS:
        raise EnvError(f"an observation of {len(content)} characters, above {MAX_CONTENT_CHARS}")
    return Message(role=role, content=content)


def check_step(obj: object) -> Step:
    """`obj` as a well-formed Step (observation checked unless done), or EnvError."""
    if not isinstance(obj, Step):
        raise EnvError(f"step() returns a Step, got {type(obj).__name__}")
    if not isinstance(obj.done, bool):
        raise EnvError(f"Step.done is a bool, got {type(obj.done).__name__}")
    reward = obj.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvError(f"Step.reward is a finite number, got {str(reward)[:40]!r}")
    observation = None if obj.done else check_message(obj.observation)
    # `info` is the environment's own (Gymnasium's); the node keeps none of it.
    return Step(observation, float(reward), obj.done)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: Any


# Hermes / Qwen tool-call syntax: <tool_call>{"name": ..., "arguments": ...}</tool_call>.
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*\})\s*</tool_call>", re.DOTALL)
# A tool's output is cut to this many characters before it becomes an observation.
MAX_TOOL_OUTPUT = 2048


class ToolEnv:
    """An environment whose model may call `tools` (name -> function of the call's arguments,
    returning text) before it answers. A call is one step: the tool runs, its output is the
    next observation (role "tool", reward 0). At most `max_tool_calls` calls per episode; the
    next one ends the episode with no reward. The arguments are the model's: a tool that raises
    on them answers "error: ... (ExceptionType)", naming the type only (a message may hold
    addresses that differ between the peer and the learner's re-run), and the episode goes on;
    the model learns from it as from a wrong answer. Not MemoryError or RecursionError: they
    depend on the process, not the arguments, so the learner's re-run could answer otherwise
    and blame an honest peer; they fail the episode (env_error) as any environment error does.
    Subclasses define `reset`, `answer` and `tools`, may declare `tool_schemas` (the module
    docstring), and may override `parse_tool_call` (default: the Hermes syntax above, the one
    tool-listing templates ask for)."""

    deterministic = True
    reward_range = (0.0, 1.0)
    tools: Mapping[str, Callable[[Any], str]] = {}
    tool_schemas: Sequence[Mapping[str, Any]] = ()
    max_tool_calls = 4

    def __init__(self) -> None:
        self.tool_calls = 0

    def parse_tool_call(self, action: str) -> ToolCall | None:
        m = _TOOL_CALL.search(action)
        if m is None:
            return None
        try:
            data = json.loads(m.group(1))
        except ValueError:
            return ToolCall("", None)  # a call, but not one any tool takes
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return ToolCall("", None)
        return ToolCall(data["name"], data.get("arguments"))

    def step(self, action: str) -> Step:
        call = self.parse_tool_call(action)
        if call is None:
            return self.answer(action)
        self.tool_calls += 1
        if self.tool_calls > self.max_tool_calls:
            return Step(None, 0.0, True, {"ended": "tool_calls"})
        tool = self.tools.get(call.name)
        # The tool's name came from the model: it is quoted, bounded, never rendered raw.
        if tool is None:
            output = f"error: no tool named {call.name[:40]!r}"
        else:
            try:
                output = tool(call.arguments)
            except (MemoryError, RecursionError):
                raise  # the process's limits, not the arguments (class doc)
            except Exception as exc:  # the arguments are the model's: its mistake, answered (class doc)
                output = f"error: {call.name[:40]!r} refused its arguments ({type(exc).__name__})"
        return Step(Message(role="tool", content=str(output)[:MAX_TOOL_OUTPUT]), 0.0, False, {"tool": call.name})

    def answer(self, action: str) -> Step:
        raise NotImplementedError

    def reset(self, seed: int) -> Message:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class EnvSpec:
    """A loaded environment: how to make one per episode, its id, budgets and bounds."""

    name: str
    env_id: str
    factory: Callable[[], Env]
    budgets: Budgets
    step_timeout_s: float
    reward_range: tuple[float, float]
    deterministic: bool
    # The environment's tool schemas, checked (`check_tools`); () when it declares none.
    tools: tuple[dict[str, Any], ...] = ()


def check_tools(name: str, declared: object, callable_names: object) -> tuple[dict[str, Any], ...]:
    """An environment's `tool_schemas` as the chat template takes them (JSON objects, copied),
    or EnvError naming what is wrong: a list of at most MAX_TOOLS `{"type": "function",
    "function": {"name": ..., ...}}` with distinct names, MAX_TOOLS_JSON characters as JSON in
    all, and each name one of the environment's `tools` (a schema the model could call and no
    tool answers would teach it a tool that is not there)."""
    if not isinstance(declared, (list, tuple)) or len(declared) > MAX_TOOLS:
        raise EnvError(f"env {name!r}: tool_schemas is a list of at most {MAX_TOOLS} schemas")
    try:
        text = json.dumps(list(declared), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise EnvError(f"env {name!r}: tool_schemas must be JSON: {exc}") from None
    if len(text) > MAX_TOOLS_JSON:
        raise EnvError(f"env {name!r}: tool_schemas take {len(text)} characters as JSON, above {MAX_TOOLS_JSON}")
    schemas = json.loads(text)
    names: list[str] = []
    for tool in schemas:
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        tool_name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(tool_name, str) or not _TOOL_NAME.fullmatch(tool_name):
            raise EnvError(f"env {name!r}: each tool schema is {{'type': 'function', 'function': {{'name': NAME, ...}}}}, "
                           f"NAME matching {_TOOL_NAME.pattern}")
        names.append(tool_name)
    if len(set(names)) != len(names):
        raise EnvError(f"env {name!r}: tool_schemas name a tool twice")
    callable_set = set(callable_names) if isinstance(callable_names, Mapping) else set()
    missing = sorted(set(names) - callable_set)
    if missing:
        raise EnvError(f"env {name!r}: tool_schemas describe {missing}, which are not among its tools")
    return tuple(schemas)


def _import_class(spec: str) -> type:
    if not _SPEC.fullmatch(spec):
        raise EnvError(f"env {spec!r} is neither a built-in ({', '.join(sorted(ENVS))}) nor 'module:Class'")
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an import runs the module's code: any error means "not importable"
        raise EnvError(f"env {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise EnvError(f"env {spec!r}: module {module_name!r} has no class {attr!r}")
    return cls


def _source_digest(cls: type) -> str | None:
    try:
        return hashlib.sha256(inspect.getsource(inspect.getmodule(cls) or cls).encode()).hexdigest()
    except (OSError, TypeError):
        return None


def env_id(name: str, options: Mapping[str, Any], budgets: Budgets, source: str | None,
           tools: Sequence[Mapping[str, Any]] = ()) -> str:
    fields: dict[str, Any] = {"env": name, "options": dict(options), "source": source,
                              "budgets": [budgets.max_turns, budgets.turn_tokens, budgets.episode_tokens]}
    # The tools are rendered into every first observation: a peer must render the same ones.
    if tools:
        fields["tools"] = list(tools)
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return f"{ENV_PREFIX}{name.replace(':', '.')}@{hashlib.sha256(blob).hexdigest()[:32]}"


def is_env_id(task_id: str) -> bool:
    """Whether a run spec's `task` names an environment (a run of episodes), not a task."""
    return task_id.startswith(ENV_PREFIX)


def peer_env(task_id: str, cfg: RunConfig) -> EnvSpec | None:
    """The environment a joining peer plays for a run spec's `task` (None: the run has none),
    built from the peer's own `[env]`, which must give the same id. ValueError, in one line with
    the remedy, when it cannot."""
    if not is_env_id(task_id):
        return None
    if cfg.env.name is None:
        raise ValueError(f"this run plays the environment {task_id!r}: set [env] (name, options, budgets) as its learner does")
    try:
        spec = load_env(cfg)
    except EnvError as exc:
        raise ValueError(f"this run plays the environment {task_id!r}, and this peer's [env] does not load: {exc}") from None
    if spec.env_id != task_id:
        raise ValueError(
            f"this run plays the environment {task_id!r}, this peer's [env] gives {spec.env_id!r}: use the run's "
            "[env] table (name, options, budgets) and the same plug-in code"
        )
    return spec


def probe_transcript(factory: Callable[[], Env], seed: int, actions: Sequence[str]) -> list[object]:
    """What an environment answers to `actions` from `reset(seed)`: compared between two runs
    at load time, a cheap refusal of environments that answer differently (it cannot prove
    determinism; the learner's re-run of every checked episode is the real check)."""
    env = factory()
    out: list[object] = [check_message(env.reset(seed))]
    for action in actions:
        step = check_step(env.step(action))
        out.append((step.observation, step.reward, step.done))
        if step.done:
            break
    return out


def _reward_range(name: str, declared: object) -> tuple[float, float]:
    if (
        isinstance(declared, (tuple, list)) and len(declared) == 2
        and all(type(x) in (int, float) and math.isfinite(x) for x in declared) and declared[0] <= declared[1]
    ):
        return float(declared[0]), float(declared[1])
    raise EnvError(f"env {name!r}: reward_range is (low, high), two finite numbers with low <= high")


def load_env(cfg: RunConfig) -> EnvSpec:
    """The environment `[env]` names, checked: importable, constructible with its options,
    deterministic (declared and probed) unless untrusted-only. EnvError with the remedy."""
    e = cfg.env
    if e.name is None:
        raise EnvError("no environment configured: set [env] name")
    builtins = ENVS
    cls = builtins.get(e.name) or _import_class(e.name)
    options = dict(e.options)
    try:
        json.dumps(options, sort_keys=True)
    except TypeError as exc:
        raise EnvError(f"env {e.name!r}: [env.options] {sorted(options)} do not fit its class: {exc}") from None
    from echo_node.envs.bounded import ENV_ERROR, call_bounded  # it builds on this module

    # The constructor is the plug-in's code like reset and step: bounded the same way.
    (made,) = call_bounded([lambda: cls(**options)], e.step_timeout_s)
    if made.error is not None:
        why = made.error.removeprefix(f"{ENV_ERROR}: ")
        if why.startswith("TypeError"):
            raise EnvError(f"env {e.name!r}: [env.options] {sorted(options)} do not fit its class: {why}")
        raise EnvError(f"env {e.name!r}: cannot construct it with [env.options] (in step_timeout_s): {why}")
    low, high = _reward_range(e.name, getattr(cls, "reward_range", (0.0, 1.0)))
    budgets = Budgets(max_turns=e.max_turns, turn_tokens=e.turn_tokens, episode_tokens=e.episode_tokens)
    source = None if e.name in builtins else _source_digest(cls)
    factory: Callable[[], Env] = lambda: cls(**options)  # noqa: E731  (one instance per episode)
    deterministic = getattr(cls, "deterministic", False) is True
    if not deterministic and not e.untrusted_only:
        raise EnvError(
            f"env {e.name!r} does not declare itself deterministic (deterministic = True): the learner cannot "
            "verify its episodes by a re-run. Mark it [env] untrusted_only = true for a private swarm"
        )
    if deterministic:
        probe = list(getattr(cls, "probe_actions", ("0", "1", "")))
        for seed in (0, 1):

            def transcript(seed: int = seed) -> list[object]:
                return probe_transcript(factory, seed, probe)

            runs = call_bounded([transcript, transcript], e.step_timeout_s * (len(probe) + 1))
            failed = next((r.error for r in runs if r.error is not None), None)
            if failed is not None:
                raise EnvError(f"env {e.name!r} failed its load-time probe: {failed}")
            if runs[0].value != runs[1].value:
                raise EnvError(f"env {e.name!r} declares itself deterministic but answered one seed's actions differently twice")
    tools = check_tools(e.name, getattr(cls, "tool_schemas", ()), getattr(cls, "tools", {}))
    eid = env_id(e.name, options, budgets, source, tools)
    if len(eid) > MAX_ENV_ID:
        raise EnvError(f"env id {eid[:40]!r}... is longer than {MAX_ENV_ID} characters; use a shorter name")
    return EnvSpec(e.name, eid, factory, budgets, e.step_timeout_s, (float(low), float(high)), deterministic, tools)


# Built-ins, after ToolEnv (calc subclasses it): their ids hash name, options and budgets only,
# since their code ships with echo-node.
from echo_node.envs.calc import CalcEnv  # noqa: E402

ENVS: dict[str, type] = {"calc": CalcEnv}
