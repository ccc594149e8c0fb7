"""The learner's save_pretrained export: plain transformers reloads it and generates the same."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from echo_node.ml.engine import TorchEngine
from echo_node.ml.export import char_tokenizer_to_hf, export_pretrained
from echo_node.ml.model import build_model, state_to_bytes, tiny_llama_config
from echo_node.ml.tokenizer import CharTokenizer

TOK = CharTokenizer()


def _greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    engine = TorchEngine(model, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
    return [g.completion_ids for g in engine.generate(prompts, max_new_tokens=6, temperature=0.0)]


def test_char_tokenizer_export_has_the_same_ids() -> None:
    hf = char_tokenizer_to_hf(TOK)
    for text in ("37+05=", "0 9", "99+99=198"):
        assert hf.encode(text) == TOK.encode_prompt(text)
        assert hf.encode(text, add_special_tokens=False) == TOK.encode(text)
        assert hf.decode(TOK.encode_prompt(text) + [TOK.eos_id], skip_special_tokens=True) == text
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (TOK.pad_id, TOK.bos_id, TOK.eos_id)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_reloads_and_generates_identically(tmp_path, dtype: torch.dtype) -> None:
    model = build_model(tiny_llama_config(TOK.vocab_size), seed=3)
    out = export_pretrained(model, TOK, tmp_path / "model", dtype=dtype, meta={"version": 7})
    assert json.loads((out / "echo_node.json").read_text()) == {"version": 7}
    assert json.loads((out / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert loaded.dtype == dtype
    # The weights are the model's, rounded to the export dtype (and nothing else).
    assert state_to_bytes(loaded) == state_to_bytes(model, dtype=dtype)
    reference = build_model(tiny_llama_config(TOK.vocab_size), seed=3).to(dtype)
    prompts = [tok.encode(p) for p in ("12+34=", "99+01=", "50+50=")]
    assert _greedy(loaded, prompts) == _greedy(reference, prompts)
    # transformers' own generate agrees with the engine on the exported directory.
    hf_out = loaded.generate(
        torch.tensor([prompts[0]]), max_new_tokens=6, do_sample=False, eos_token_id=TOK.eos_id, pad_token_id=TOK.pad_id
    )
    assert hf_out[0, len(prompts[0]):].tolist()[: len(_greedy(loaded, prompts[:1])[0])] == _greedy(loaded, prompts[:1])[0]


def test_export_replaces_the_previous_one(tmp_path) -> None:
    out = tmp_path / "model"
    export_pretrained(build_model(tiny_llama_config(TOK.vocab_size), seed=1), TOK, out, dtype=torch.float32)
    second = build_model(tiny_llama_config(TOK.vocab_size), seed=2)
    export_pretrained(second, TOK, out, dtype=torch.float32)
    assert state_to_bytes(AutoModelForCausalLM.from_pretrained(out, local_files_only=True)) == state_to_bytes(second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temp or old directory left
