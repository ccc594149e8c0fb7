"""Weight serialization: deterministic bytes, strict loading, checkpoints carry the version."""

import pytest
import torch

from echo_node.ml.model import (
    build_model,
    canonical_state,
    load_checkpoint,
    load_state_bytes,
    save_checkpoint,
    state_to_bytes,
    tensors_to_bytes,
    tiny_llama_config,
)

torch.set_num_threads(1)


def _arch() -> dict:
    return {**tiny_llama_config(16), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2}


def test_build_is_deterministic_and_keeps_global_rng() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(_arch(), seed=3)
    assert torch.equal(torch.rand(1), before)  # global RNG untouched
    b = build_model(_arch(), seed=3)
    assert state_to_bytes(a) == state_to_bytes(b)
    assert state_to_bytes(a) != state_to_bytes(build_model(_arch(), seed=4))
    assert all(p.dtype == torch.float32 for p in a.parameters())


def test_tied_weights_serialized_once_and_round_trip() -> None:
    src, dst = build_model(_arch(), seed=1), build_model(_arch(), seed=2)
    keys = canonical_state(src).keys()
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    load_state_bytes(dst, state_to_bytes(src))
    assert state_to_bytes(dst) == state_to_bytes(src)
    assert dst.lm_head.weight.data_ptr() == dst.model.embed_tokens.weight.data_ptr()
    assert torch.equal(dst.lm_head.weight, src.model.embed_tokens.weight)


def test_strict_rejection_leaves_model_untouched() -> None:
    model = build_model(_arch(), seed=1)
    before = state_to_bytes(model)
    other = canonical_state(build_model(_arch(), seed=2))
    missing = dict(other)
    missing.pop("model.norm.weight")
    extra = {**other, "bogus": torch.zeros(1)}
    wrong_shape = {**other, "model.norm.weight": torch.zeros(31)}
    wrong_dtype = {**other, "model.norm.weight": other["model.norm.weight"].double()}
    for bad in (missing, extra, wrong_shape, wrong_dtype):
        with pytest.raises(ValueError):
            load_state_bytes(model, tensors_to_bytes(bad))
    with pytest.raises(ValueError):
        load_state_bytes(model, b"not safetensors")
    assert state_to_bytes(model) == before


def test_checkpoint_round_trip(tmp_path) -> None:
    model = build_model(_arch(), seed=1)
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(model, path, version=17)
    data, version = load_checkpoint(path)
    assert version == 17 and data == state_to_bytes(model)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.safetensors"]  # no temp file left


def test_load_pretrained_local_directory(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from echo_node.ml.model import load_pretrained
    from echo_node.ml.tokenizer import load_tokenizer

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate("0123456789+= ")}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    model = build_model(_arch(), seed=0)
    model.save_pretrained(tmp_path)
    hf_tok.save_pretrained(tmp_path)

    loaded, tok = load_pretrained(str(tmp_path))
    assert state_to_bytes(loaded) == state_to_bytes(model)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode_prompt("12+") == [1, 4, 5, 13]
    assert tok.decode([4, 2, 5]) == "1"  # stops at eos
    assert load_tokenizer({"kind": "hf"}, str(tmp_path)).encode("12") == [4, 5]
