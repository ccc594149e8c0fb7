"""tiny_hf: the locally built HF model directory loads offline, tokenizes digits one by one, has a
chat template, rebuilds byte for byte, and TorchEngine's greedy output equals HF generate's."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, Qwen2ForCausalLM

from echo_node.ml.engine import TorchEngine
from echo_node.ml.tiny_hf import build_tiny_model, main
from echo_node.ml.tokenizer import HFTokenizerAdapter

torch.set_num_threads(1)

FAMILIES = ["qwen2", "llama"]
CLASSES = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}


@pytest.fixture(scope="module", params=FAMILIES)
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    family = request.param
    return family, build_tiny_model(tmp_path_factory.mktemp(family), family=family)


@pytest.fixture(scope="module", params=FAMILIES)
def warmed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    # A few warm-up steps: greedy completions then hold digits and end in eos at different steps,
    # where a random model only repeats its last token and never stops.
    family = request.param
    return family, build_tiny_model(tmp_path_factory.mktemp(f"{family}-warm"), family=family, warmup_steps=40)


def _load(path: Path) -> tuple[torch.nn.Module, HFTokenizerAdapter]:
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model.eval(), HFTokenizerAdapter(AutoTokenizer.from_pretrained(path, local_files_only=True))


def test_reloads_offline_with_consistent_special_ids(built: tuple[str, Path]) -> None:
    family, path = built
    model, tok = _load(path)
    cfg = model.config
    assert type(model) is CLASSES[family]
    assert cfg.vocab_size == tok.vocab_size == 512
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA: K/V heads get repeated
    assert 500_000 < sum(p.numel() for p in model.parameters()) < 3_000_000
    if family == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        assert tok.bos_id is None and tok.pad_id == tok.eos_id
    else:
        assert tok.bos_id is not None and tok.pad_id != tok.eos_id
    gen = model.generation_config
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)


def test_digits_tokenize_one_per_digit_and_round_trip(built: tuple[str, Path]) -> None:
    _, path = built
    _, tok = _load(path)
    assert [tok.decode([i]) for i in tok.encode("0123456789")] == list("0123456789")
    ids = tok.encode("37+05=042")
    assert len(ids) == 9 and tok.decode(ids) == "37+05=042"
    # Prompt and answer tokenized apart give the ids of the whole: what warm-up and RL rely on.
    assert tok.encode("37+05=") + tok.encode("042") == ids
    assert tok.decode(tok.encode_prompt("Tom has 3 apples.")) == "Tom has 3 apples."


def test_chat_template_is_chatml(built: tuple[str, Path]) -> None:
    family, path = built
    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    text = hf.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    bos = "<|begin_of_text|>" if family == "llama" else ""
    assert text == bos + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = hf.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)["input_ids"]
    assert ids.count(hf.convert_tokens_to_ids("<|im_start|>")) == 2 and hf.decode(ids) == text


def test_rebuild_is_byte_identical_and_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    rng_before = torch.get_rng_state()
    a = build_tiny_model(tmp_path / "a", family="llama", seed=3)
    b = build_tiny_model(tmp_path / "b", family="llama", seed=3)
    c = build_tiny_model(tmp_path / "c", family="llama", seed=4)
    assert torch.equal(torch.get_rng_state(), rng_before)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    # The tokenizer depends on (family, vocab_size) only.
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_warmup_changes_the_weights_deterministically(tmp_path: Path) -> None:
    plain = build_tiny_model(tmp_path / "plain")
    warm = [build_tiny_model(tmp_path / f"warm{i}", warmup_steps=2) for i in range(2)]
    assert (warm[0] / "model.safetensors").read_bytes() == (warm[1] / "model.safetensors").read_bytes()
    assert (warm[0] / "model.safetensors").read_bytes() != (plain / "model.safetensors").read_bytes()


def test_vocab_larger_than_the_corpus_supports_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="smaller vocabulary"):
        build_tiny_model(tmp_path, vocab_size=4096)


def _hf_greedy(model: torch.nn.Module, prompts: list[list[int]], eos: int, pad: int, max_new: int) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=pad)
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


def test_torch_engine_greedy_matches_hf_generate(warmed: tuple[str, Path]) -> None:
    family, path = warmed
    model, tok = _load(path)
    texts = ["37+05=", "Tom has 3 apples and buys 4 more. How many apples does he have?", "9+1=", "hi"]
    prompts = [tok.encode_prompt(t) for t in texts]
    expected = _hf_greedy(model, prompts, tok.eos_id, tok.pad_id, 10)
    assert len({len(row) for row in expected}) > 1 and tok.eos_id in expected[0]
    # None: the lean Llama stepper for llama, HF's forward for qwen2; False: HF's forward always.
    for fast_path in (None, False) if family == "llama" else (None,):
        engine = TorchEngine(model, eos_id=tok.eos_id, pad_id=tok.pad_id, fast_path=fast_path)
        gens = engine.generate(prompts, max_new_tokens=10, temperature=0.0)
        assert [g.completion_ids for g in gens] == expected, f"fast_path={fast_path}"


def test_cli_prints_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "m"), "--family", "llama", "--seed", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and str(tmp_path / "m") in out[0] and "parameters" in out[0]
    assert (tmp_path / "m" / "model.safetensors").is_file()
