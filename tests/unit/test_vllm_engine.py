"""VLLMEngine's CPU-testable parts: weight mapping and checkpoint checks, vLLM output conversion,
the chunk loop's version bookkeeping (with a fake sampler), the worker mixin (with a fake worker),
and the engine's glue over a fake `vllm` module. vLLM itself runs only in tests/gpu."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file

from echo_node.ml import vllm_engine
from echo_node.ml.engine import Generation, WeightState
from echo_node.ml.model import build_model, canonical_state, state_to_bytes, tiny_llama_config
from echo_node.ml.vllm_engine import (
    ChunkRequest,
    VLLMWorkerExtension,
    check_sampling,
    check_state_fits,
    check_vllm_available,
    checkpoint_shapes,
    completion_from_vllm,
    row_seed,
    run_chunks,
    vllm_weight_items,
    weight_pieces,
)

torch.set_num_threads(1)

EOS = 2


def _model(*, tied: bool = True, seed: int = 0):
    arch = {**tiny_llama_config(16), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": tied}
    return build_model(arch, seed=seed)


def _model_dir(tmp_path: Path, *, tied: bool = True, **save_kwargs: Any) -> Path:
    out = tmp_path / ("tied" if tied else "untied")
    _model(tied=tied).save_pretrained(out, **save_kwargs)
    return out


# --- availability and import ----------------------------------------------------------------


def test_module_import_does_not_import_vllm() -> None:
    code = "import sys, echo_node.ml.vllm_engine; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_check_vllm_available_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def no_vllm(name: str, package: str | None = None) -> Any:
        return None if name == "vllm" else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", no_vllm)
    with pytest.raises(RuntimeError, match=r"^--engine vllm needs vLLM: pip install 'echo-node\[vllm\]'$"):
        check_vllm_available()

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"^--engine vllm needs a CUDA GPU; use --engine torch on CPU$"):
        check_vllm_available()


# --- weights --------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_weight_items_keep_hf_names_cast_floats_and_drop_a_tied_head(tied: bool) -> None:
    model = _model(tied=tied)
    full = {k: v.detach() for k, v in model.state_dict().items()}  # with the tied alias, if any
    full["step_counter"] = torch.tensor([3], dtype=torch.int64)
    items = dict(vllm_weight_items(full, tied=tied, dtype=torch.bfloat16))
    assert ("lm_head.weight" in items) == (not tied)
    assert set(items) == set(full) - ({"lm_head.weight"} if tied else set())
    assert items["step_counter"].dtype == torch.int64
    for name, t in items.items():
        if name != "step_counter":
            assert t.dtype == torch.bfloat16 and t.device.type == "cpu"
            torch.testing.assert_close(t, full[name].to(torch.bfloat16))


@pytest.mark.parametrize("tied", [True, False])
def test_checkpoint_shapes_are_the_canonical_state(tmp_path: Path, tied: bool) -> None:
    # The contract load_weights checks against: save_pretrained's names are canonical_state's.
    shapes = checkpoint_shapes(_model_dir(tmp_path, tied=tied), tied=tied)
    canonical = canonical_state(_model(tied=tied))
    assert shapes == {k: tuple(v.shape) for k, v in canonical.items()}
    assert ("lm_head.weight" in shapes) == (not tied)


def test_checkpoint_shapes_read_shards_and_skip_rotary_tables(tmp_path: Path) -> None:
    sharded = _model_dir(tmp_path, max_shard_size="8KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert checkpoint_shapes(sharded, tied=True) == {k: tuple(v.shape) for k, v in canonical_state(_model()).items()}

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2), "lm_head.weight": torch.zeros(4, 2),
               "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(1)}, str(legacy / "model.safetensors"))
    assert checkpoint_shapes(legacy, tied=True) == {"model.embed_tokens.weight": (4, 2)}
    with pytest.raises(ValueError, match="no model.safetensors"):
        checkpoint_shapes(tmp_path / "nothing-here", tied=True)


def test_check_state_fits_refuses_missing_extra_and_reshaped() -> None:
    model = _model()
    expected = {k: tuple(v.shape) for k, v in canonical_state(model).items()}
    items = vllm_weight_items(canonical_state(model), tied=True, dtype=torch.float32)
    check_state_fits(items, expected)
    with pytest.raises(ValueError, match="missing"):
        check_state_fits(items[1:], expected)
    with pytest.raises(ValueError, match="unexpected"):
        check_state_fits([*items, ("extra.weight", torch.zeros(1))], expected)
    name, t = items[0]
    with pytest.raises(ValueError, match="shape"):
        check_state_fits([(name, t.reshape(-1)), *items[1:]], expected)


def test_weight_pieces_split_by_size_and_keep_every_tensor() -> None:
    items = [(f"w{i}", torch.full((10,), float(i))) for i in range(5)] + [("big", torch.zeros(100))]
    pieces = weight_pieces(items, max_bytes=100)  # 40 bytes per small tensor, 400 for "big"
    decoded = [st_load(p) for p in pieces]
    assert [sorted(d) for d in decoded] == [["w0", "w1"], ["w2", "w3"], ["w4"], ["big"]]
    merged = {k: v for d in decoded for k, v in d.items()}
    for name, t in items:
        assert torch.equal(merged[name], t)


# --- vLLM outputs ---------------------------------------------------------------------------


@dataclass
class _Logprob:
    logprob: float


def _entries(ids: list[int], lps: list[float]) -> list[dict[int, _Logprob]]:
    # vLLM's dict per position: the sampled token, and with logprobs > 0 the top ones beside it.
    return [{t: _Logprob(lp), t + 100: _Logprob(lp - 1.0)} for t, lp in zip(ids, lps)]


def test_completion_from_vllm_stops_at_eos_inclusive() -> None:
    ids, lps = [5, 6, EOS, 7], [-0.1, -0.2, -0.3, -0.4]
    assert completion_from_vllm(ids, _entries(ids, lps), eos_id=EOS) == ([5, 6, EOS], [-0.1, -0.2, -0.3])
    # Hitting max_tokens first: every token, no eos.
    assert completion_from_vllm(ids[:2], _entries(ids[:2], lps[:2]), eos_id=EOS) == ([5, 6], [-0.1, -0.2])
    assert completion_from_vllm([], [], eos_id=EOS) == ([], [])


def test_completion_from_vllm_rejects_missing_or_broken_logprobs() -> None:
    with pytest.raises(RuntimeError, match="no log-probs"):
        completion_from_vllm([5], None, eos_id=EOS)
    with pytest.raises(RuntimeError, match="2 tokens but 1"):
        completion_from_vllm([5, 6], _entries([5], [-0.1]), eos_id=EOS)
    with pytest.raises(RuntimeError, match="lack the sampled token 6"):
        completion_from_vllm([5, 6], [{5: _Logprob(-0.1)}, {7: _Logprob(-0.2)}], eos_id=EOS)
    for bad in (float("nan"), float("-inf"), float("inf")):
        with pytest.raises(RuntimeError, match="position 1"):
            completion_from_vllm([5, 6], _entries([5, 6], [-0.1, bad]), eos_id=EOS)


def test_check_sampling_refuses_what_breaks_the_logprob_convention() -> None:
    check_sampling([[1, 2]], max_new_tokens=4, temperature=0.0, top_p=1.0)
    check_sampling([[1, 2]], max_new_tokens=4, temperature=0.01, top_p=1.0)
    with pytest.raises(ValueError, match="top_p = 1"):
        check_sampling([[1, 2]], max_new_tokens=4, temperature=1.0, top_p=0.9)
    with pytest.raises(ValueError, match="silently raises"):
        check_sampling([[1, 2]], max_new_tokens=4, temperature=0.005, top_p=1.0)
    with pytest.raises(ValueError, match="temperature"):
        check_sampling([[1, 2]], max_new_tokens=4, temperature=-1.0, top_p=1.0)
    with pytest.raises(ValueError, match="bos"):
        check_sampling([[1], []], max_new_tokens=4, temperature=1.0, top_p=1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_sampling([[1]], max_new_tokens=0, temperature=1.0, top_p=1.0)


# --- the chunk loop -------------------------------------------------------------------------


class _FakeModel:
    """A deterministic stand-in for vLLM + weights: the next token is a function of the whole
    context and of the loaded weights ("w", an int), and its log-prob encodes both, so a test can
    tell which weights produced every token given which prefix."""

    def __init__(self, w: int = 0, *, vocab: int = 13, version: int = 0) -> None:
        self.w = w
        self.vocab = vocab
        self.version = version
        self.loads: list[int] = []
        self.calls: list[tuple[list[ChunkRequest], int]] = []

    def load_weights(self, state: WeightState, version: int) -> None:
        assert isinstance(state, dict)
        self.w = int(state["w"].item())
        self.version = version
        self.loads.append(version)

    def next_token(self, context: list[int]) -> int:
        return (sum((i + 1) * t for i, t in enumerate(context)) * 7 + len(context) + self.w * 5) % self.vocab

    def logprob(self, context: list[int]) -> float:
        return -(len(context) + 100 * self.w) / 1000

    def sample(self, requests: list[ChunkRequest], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        self.calls.append((requests, max_tokens))
        out = []
        for r in requests:
            ctx, ids, lps = list(r.context), [], []
            while len(ids) < max_tokens:
                ids.append(self.next_token(ctx))
                lps.append(self.logprob(ctx))
                ctx.append(ids[-1])
                if ids[-1] == EOS:
                    break
            out.append((ids, lps))
        return out


def _reference(prompt: list[int], steps: list[int], max_new: int) -> tuple[list[int], list[float], list[int]]:
    """What a per-token engine with weights `steps[t]` at step t produces (weights as versions)."""
    fake, ctx = _FakeModel(), list(prompt)
    ids, lps = [], []
    for t in range(max_new):
        fake.w = steps[t]
        ids.append(fake.next_token(ctx))
        lps.append(fake.logprob(ctx))
        ctx.append(ids[-1])
        if ids[-1] == EOS:
            break
    return ids, lps, steps[: len(ids)]


# With _FakeModel's weights 0, chunks of 2 and 9 tokens: row 2 ends at eos in the first chunk,
# row 0 in the second, row 1 runs to the end; weights 1 from token 4 on end row 3 at token 6.
PROMPTS = [[1, 4], [1, 5, 6], [1, 3, 6], [1, 9]]


def _run(fake: _FakeModel, *, chunk: int, max_new: int, swap=None, seed: int | None = None) -> list[Generation]:
    return run_chunks(fake, PROMPTS, max_new_tokens=max_new, chunk_tokens=chunk, eos_id=EOS, seed=seed,
                      sample=fake.sample, swap=swap)


def test_chunks_without_a_swap_equal_one_chunk() -> None:
    one = _run(_FakeModel(), chunk=12, max_new=12)
    for chunk in (1, 3, 5):
        fake = _FakeModel()
        assert _run(fake, chunk=chunk, max_new=12) == one
    for g, p in zip(one, PROMPTS):
        ids, lps, versions = _reference(p, [0] * 12, 12)
        assert (g.completion_ids, g.logprobs, g.token_versions) == (ids, lps, versions)
    assert any(g.completion_ids[-1] == EOS for g in one) and any(len(g.completion_ids) == 12 for g in one)


def test_chunk_budgets_and_continuation_contexts() -> None:
    fake = _FakeModel()
    gens = _run(fake, chunk=3, max_new=7)
    assert [(len(requests), budget) for requests, budget in fake.calls] == [(4, 3), (3, 3), (2, 1)]
    # A continuation is the row's prompt + its tokens so far; finished rows are asked no more.
    for n, (requests, _) in enumerate(fake.calls):
        for req in requests:
            assert any(req.context == p + g.completion_ids[: 3 * n] for p, g in zip(PROMPTS, gens))
        if n > 0:
            assert len(requests) <= len(fake.calls[n - 1][0])


class _SwapAt:
    """Hands over weights `w` as `version` on its `call`-th call."""

    def __init__(self, call: int, w: int, version: int) -> None:
        self.call, self.w, self.version, self.calls = call, w, version, 0

    def __call__(self) -> tuple[WeightState, int] | None:
        self.calls += 1
        return ({"w": torch.tensor(self.w)}, self.version) if self.calls == self.call else None


def test_a_swap_between_chunks_tags_each_token_with_the_weights_that_sampled_it() -> None:
    fake = _FakeModel(w=0, version=0)
    swap = _SwapAt(call=2, w=1, version=7)  # before the third chunk, i.e. from token 4 on (chunk 2)
    gens = _run(fake, chunk=2, max_new=9, swap=swap)
    assert fake.loads == [7] and fake.version == 7
    # The hook runs between chunks only: never before the first, once per later chunk.
    assert swap.calls == len(fake.calls) - 1
    for g, p in zip(gens, PROMPTS):
        ids, lps, _ = _reference(p, [0] * 4 + [1] * 5, 9)
        assert (g.completion_ids, g.logprobs) == (ids, lps)
        assert g.token_versions == [0] * min(4, len(ids)) + [7] * max(0, len(ids) - 4)


def test_a_row_finished_before_the_swap_keeps_its_tags() -> None:
    fake = _FakeModel()
    base = _run(_FakeModel(), chunk=2, max_new=9)
    assert base[2] == Generation([9, EOS], [-0.003, -0.004], [0, 0])
    gens = _run(fake, chunk=2, max_new=9, swap=_SwapAt(call=1, w=3, version=4))
    assert gens[2] == base[2]
    assert gens[1].token_versions == [0, 0] + [4] * 7 and gens[1].completion_ids != base[1].completion_ids


def test_seeds_differ_per_row_and_chunk_and_repeat_per_call() -> None:
    fake = _FakeModel()
    _run(fake, chunk=2, max_new=6, seed=5)
    seeds = [[r.seed for r in requests] for requests, _ in fake.calls]
    flat = [s for chunk in seeds for s in chunk]
    assert len(set(flat)) == len(flat) and all(s is not None and 0 <= s < 2**63 for s in flat)
    assert seeds[0] == [row_seed(5, 0, r) for r in range(len(PROMPTS))]
    again = _FakeModel()
    _run(again, chunk=2, max_new=6, seed=5)
    assert [[r.seed for r in requests] for requests, _ in again.calls] == seeds
    unseeded = _FakeModel()
    _run(unseeded, chunk=2, max_new=6)
    assert all(r.seed is None for requests, _ in unseeded.calls for r in requests)


def test_a_short_answer_without_eos_ends_the_row_and_contract_breaches_raise() -> None:
    def short(requests: list[ChunkRequest], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        return [([7], [-0.5]) for _ in requests]  # e.g. vLLM at the model's context length

    fake = _FakeModel()
    gens = run_chunks(fake, PROMPTS, max_new_tokens=6, chunk_tokens=3, eos_id=EOS, seed=None, sample=short, swap=None)
    assert all(g == Generation([7], [-0.5], [0]) for g in gens)

    def too_long(requests: list[ChunkRequest], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        return [([7] * (max_tokens + 1), [-0.5] * (max_tokens + 1)) for _ in requests]

    with pytest.raises(RuntimeError, match="asked"):
        run_chunks(fake, PROMPTS, max_new_tokens=6, chunk_tokens=3, eos_id=EOS, seed=None, sample=too_long, swap=None)
    with pytest.raises(RuntimeError, match="answered 0 of 4"):
        run_chunks(fake, PROMPTS, max_new_tokens=6, chunk_tokens=3, eos_id=EOS, seed=None,
                   sample=lambda requests, n: [], swap=None)
    with pytest.raises(ValueError, match="chunk_tokens"):
        run_chunks(fake, PROMPTS, max_new_tokens=6, chunk_tokens=0, eos_id=EOS, seed=None, sample=short, swap=None)
    assert run_chunks(fake, [], max_new_tokens=6, chunk_tokens=3, eos_id=EOS, seed=None, sample=short, swap=None) == []


def test_row_seed_is_stable_and_63_bit() -> None:
    assert row_seed(1, 2, 3) == row_seed(1, 2, 3)
    values = {row_seed(s, c, r) for s in range(3) for c in range(3) for r in range(3)}
    assert len(values) == 27 and max(values) < 2**63


# --- the worker mixin and the engine's glue, over fakes ---------------------------------------


class _FakeVLLMModel(torch.nn.Module):
    """vLLM's model as the worker mixin sees it: `load_weights` copies HF-named tensors into
    parameters named otherwise (as vLLM's fused ones are) and returns the names it wrote."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.params = {n.replace(".", "/"): torch.nn.Parameter(t.clone()) for n, t in canonical_state(hf).items()}
        self.fused = torch.nn.ParameterDict(self.params)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        written = set()
        for name, t in weights:
            key = name.replace(".", "/")
            self.params[key].data.copy_(t)
            written.add(f"fused.{key}")
        return written


@dataclass
class _FakeWorker(VLLMWorkerExtension):
    model_runner: Any = None


def test_worker_mixin_loads_pieces_and_reports_unwritten_parameters() -> None:
    source, target = _model(seed=1), _model(seed=2)
    worker = _FakeWorker(model_runner=types.SimpleNamespace(model=_FakeVLLMModel(target)))
    items = vllm_weight_items(canonical_state(source), tied=True, dtype=torch.float32)
    pieces = weight_pieces(items, max_bytes=2048)
    assert len(pieces) > 1
    worker.echo_weights_begin()
    for blob in pieces[:-1]:
        worker.echo_weights_piece(blob)
    missing = worker.echo_weights_end()
    assert missing and all(name.startswith("fused.") for name in missing)
    worker.echo_weights_begin()
    for blob in pieces:
        worker.echo_weights_piece(blob)
    assert worker.echo_weights_end() == []
    model = worker.model_runner.model
    for name, t in canonical_state(source).items():
        assert torch.equal(model.params[name.replace(".", "/")], t)


@dataclass
class _FakeLLM:
    """`vllm.LLM` as VLLMEngine uses it: generate over TokensPrompts, collective_rpc by method
    name into a worker carrying the mixin, reset_prefix_cache. The toy sampler is _FakeModel's,
    with weights "w" read from the loaded `model.norm.weight`."""

    kwargs: dict[str, Any]
    worker: _FakeWorker = field(init=False)
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        module, _, qualname = self.kwargs["worker_extension_cls"].rpartition(".")
        assert getattr(sys.modules[module], qualname) is VLLMWorkerExtension
        hf = build_model(self._arch(), seed=0)
        self.worker = _FakeWorker(model_runner=types.SimpleNamespace(model=_FakeVLLMModel(hf)))

    @staticmethod
    def _arch() -> dict[str, Any]:
        return {**tiny_llama_config(16), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 2, "num_key_value_heads": 1}

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.log.append(method)
        for a in args:
            assert isinstance(a, bytes)  # what msgpack carries natively
        return [getattr(self.worker, method)(*args)]

    def reset_prefix_cache(self) -> bool:
        self.log.append("reset_prefix_cache")
        return True

    def generate(self, prompts: list[dict[str, list[int]]], params: list[Any], *, use_tqdm: bool) -> list[Any]:
        assert not use_tqdm and len(prompts) == len(params)
        w = int(self.worker.model_runner.model.params["model/norm/weight"].sum().item())
        fake = _FakeModel(w=w)
        self.log.append("generate")
        outputs = []
        for prompt, p in zip(prompts, params):
            assert p.n == 1 and p.logprobs == 0 and p.top_p == 1.0 and p.stop_token_ids == [EOS]
            [(ids, lps)] = fake.sample([ChunkRequest(prompt["prompt_token_ids"], p.seed)], p.max_tokens)
            completion = types.SimpleNamespace(token_ids=ids, logprobs=_entries(ids, lps))
            outputs.append(types.SimpleNamespace(outputs=[completion]))
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> list[_FakeLLM]:
    made: list[_FakeLLM] = []

    def llm(**kwargs: Any) -> _FakeLLM:
        made.append(_FakeLLM(kwargs))
        return made[-1]

    vllm = types.ModuleType("vllm")
    vllm.LLM = llm  # type: ignore[attr-defined]
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    return made


def test_engine_glue_over_a_fake_vllm(tmp_path: Path, fake_vllm: list[_FakeLLM]) -> None:
    model_dir = tmp_path / "m"
    build_model(_FakeLLM._arch(), seed=0).save_pretrained(model_dir)
    engine = vllm_engine.VLLMEngine(str(model_dir), dtype="float32", eos_id=EOS, pad_id=0, chunk_tokens=2, seed=3)
    [llm] = fake_vllm
    assert {k: llm.kwargs[k] for k in ("logprobs_mode", "enable_prefix_caching", "skip_tokenizer_init",
                                       "generation_config", "dtype", "seed")} == {
        "logprobs_mode": "processed_logprobs", "enable_prefix_caching": True, "skip_tokenizer_init": True,
        "generation_config": "vllm", "dtype": "float32", "seed": 3}

    # No hook: one LLM.generate call, outputs in prompt order, tagged with the current version.
    gens = engine.generate(PROMPTS, max_new_tokens=6, temperature=1.0, seed=0)
    assert llm.log == ["generate"]
    expected = _run(_FakeModel(w=16), chunk=6, max_new=6)  # norm weights init to ones: w = 16
    assert gens == expected

    # A state that does not fit never reaches vLLM; one that fits is loaded, then the cache reset.
    llm.log.clear()
    other = build_model(_FakeLLM._arch(), seed=1)
    with torch.no_grad():
        other.model.norm.weight.fill_(2.0)  # w = 32
    bad = canonical_state(other)
    bad.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights(bad, version=1)
    with pytest.raises(ValueError, match="safetensors"):
        engine.load_weights(b"not a blob", version=1)
    assert llm.log == [] and engine.version == 0
    engine.load_weights(state_to_bytes(other), version=1)
    assert llm.log[0] == "echo_weights_begin" and llm.log[-2:] == ["echo_weights_end", "reset_prefix_cache"]
    assert engine.version == 1

    # A hook: chunks of 2, the swap lands between chunks and the tags follow it.
    third = build_model(_FakeLLM._arch(), seed=2)
    with torch.no_grad():
        third.model.norm.weight.fill_(3.0)  # w = 48
    calls = []

    def swap() -> tuple[WeightState, int] | None:
        calls.append(1)
        return (state_to_bytes(third), 2) if len(calls) == 1 else None

    gens = engine.generate(PROMPTS, max_new_tokens=6, temperature=1.0, seed=0, swap=swap)
    for g, p in zip(gens, PROMPTS):
        ids, lps, _ = _reference(p, [32] * 2 + [48] * 4, 6)
        assert (g.completion_ids, g.logprobs) == (ids, lps)
        assert g.token_versions == [1] * min(2, len(ids)) + [2] * max(0, len(ids) - 2)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS, max_new_tokens=6, temperature=1.0, top_p=0.5)


def test_chunked_continuations_with_a_real_model_keep_the_logprob_guarantee() -> None:
    """run_chunks over a real model (TorchEngine as the per-chunk sampler, as vLLM is on a GPU):
    without a swap, chunking changes nothing; with one, every token's log-prob is the one the
    learner recomputes under the weights its tag names, given its whole prefix."""
    from echo_node.ml.engine import TorchEngine
    from echo_node.ml.grpo import sequence_logprobs

    class TorchChunks:
        def __init__(self, model: torch.nn.Module) -> None:
            self.engine = TorchEngine(model, eos_id=EOS, pad_id=0)
            self.version = 0

        def load_weights(self, state: WeightState, version: int) -> None:
            self.engine.load_weights(state, version)
            self.version = version

        def sample(self, requests: list[ChunkRequest], max_tokens: int) -> list[tuple[list[int], list[float]]]:
            gens = self.engine.generate([r.context for r in requests], max_new_tokens=max_tokens, temperature=0.0)
            return [(g.completion_ids, g.logprobs) for g in gens]

    def arch_model(seed: int) -> torch.nn.Module:
        # A wide init makes a random model's greedy output vary from step to step.
        return build_model({**tiny_llama_config(16), "hidden_size": 32, "intermediate_size": 64,
                            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                            "initializer_range": 0.5}, seed=seed)

    prompts = [[1, 4, 5], [1, 6], [1, 7, 8, 9], [1, 3]]
    first, second = arch_model(0), arch_model(1)
    one_shot = TorchEngine(first, eos_id=EOS, pad_id=0).generate(prompts, max_new_tokens=10, temperature=0.0)
    target = TorchChunks(arch_model(0))
    chunked = run_chunks(target, prompts, max_new_tokens=10, chunk_tokens=3, eos_id=EOS, seed=None,
                         sample=target.sample, swap=None)
    assert [g.completion_ids for g in chunked] == [g.completion_ids for g in one_shot]
    for a, b in zip(chunked, one_shot):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)

    swaps = iter([None, (state_to_bytes(second), 1)])  # lands before the third chunk (token 6)
    mixed = run_chunks(target, prompts, max_new_tokens=10, chunk_tokens=3, eos_id=EOS, seed=None,
                       sample=target.sample, swap=lambda: next(swaps, None))
    assert any(1 in g.token_versions for g in mixed)
    comps = [g.completion_ids for g in mixed]
    with torch.no_grad():
        under = {0: sequence_logprobs(first, prompts, comps, 0)[0], 1: sequence_logprobs(second, prompts, comps, 0)[0]}
    for i, g in enumerate(mixed):
        assert g.token_versions == [0] * min(6, len(comps[i])) + [1] * max(0, len(comps[i]) - 6)
        for pos, (lp, v) in enumerate(zip(g.logprobs, g.token_versions)):
            assert abs(lp - float(under[v][i, pos])) < 1e-5
