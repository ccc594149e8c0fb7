"""`echo-node import-gguf`: a GGUF file into a local HF model directory, and bad files refused.

The GGUF files here are written by the test (`write_tiny_gguf`) from the tiny Llama
`echo-node tiny-model` builds, with llama.cpp's tensor names and Q/K row order, so a round trip
checks the import reproduces the source model's weights, tokenizer and chat template exactly. A
GGUF file is untrusted input: every broken or hostile one ends in one `error:` line and exit 2.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from echo_node.cli import main
from echo_node.ml import gguf_import
from echo_node.ml.gguf_import import GgufImportError, import_gguf
from echo_node.ml.model import canonical_state, load_pretrained
from echo_node.ml.tiny_hf import build_tiny_model

gguf = pytest.importorskip("gguf", reason="GGUF files need the gguf package (pip install gguf; scripts/setup.sh installs it)")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (its convert script's `permute`); transformers undoes it on load."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(model_dir: Path, path: Path) -> None:
    """The Llama model in `model_dir` as an F32 GGUF file with a byte-level BPE tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    backend = json.loads(tok.backend_tokenizer.to_str())
    vocab = {t: i for t, i in backend["model"]["vocab"].items()}
    for added in backend["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["id"] for a in backend["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]])
    if tok.bos_token_id is not None:
        w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    state = {k: v.numpy() for k, v in canonical_state(model).items()}
    w.add_tensor("token_embd.weight", state.pop("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", state.pop("model.norm.weight"))
    if "lm_head.weight" in state:
        w.add_tensor("output.weight", state.pop("lm_head.weight"))
    for name, value in state.items():
        _, _, layer, rest = name.split(".", 3)
        short = _LAYER_NAMES[rest.removesuffix(".weight")]
        if short == "attn_q":
            value = _permute(value, cfg.num_attention_heads)
        elif short == "attn_k":
            value = _permute(value, cfg.num_key_value_heads)
        w.add_tensor(f"blk.{layer}.{short}.weight", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gguf")
    source = build_tiny_model(root / "llama", family="llama", vocab_size=384)
    write_tiny_gguf(source, root / "tiny.gguf")
    return source, root / "tiny.gguf"


def _import_cli(src: Path, out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    code = main(["import-gguf", str(src), str(out), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("echo-node import-gguf: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_import_reproduces_the_model_tokenizer_and_chat_template(
    tiny_gguf: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, path = tiny_gguf
    code, out, err = _import_cli(path, tmp_path / "model", capsys)
    assert code == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["architecture"] == "LlamaForCausalLM" and report["chat_template"] and report["dtype"] == "float32"
    # What --model DIR loads: the same weights bit for bit, the same prompts, the same template.
    want, want_tok = load_pretrained(str(source), chat=True)
    got, got_tok = load_pretrained(str(tmp_path / "model"), chat=True)
    a, b = canonical_state(want), canonical_state(got)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert report["parameters"] == sum(t.numel() for t in b.values())
    assert got_tok.encode_prompt("What is 12+7?") == want_tok.encode_prompt("What is 12+7?")
    assert AutoTokenizer.from_pretrained(tmp_path / "model").chat_template == AutoTokenizer.from_pretrained(source).chat_template
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 4
    # Where it came from is not part of the model (a run's fingerprint hashes the config).
    assert str(path.parent) not in (tmp_path / "model" / "config.json").read_text()


def test_import_in_bfloat16_into_an_empty_directory(tiny_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = import_gguf(tiny_gguf[1], tmp_path / "empty", dtype=torch.bfloat16)
    assert result.dtype == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "empty", local_files_only=True)
    assert model.dtype == torch.bfloat16


def test_a_non_empty_directory_is_refused_and_left_alone(tiny_gguf: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, _, err = _import_cli(tiny_gguf[1], out, capsys)
    assert code == 2 and "is not empty" in _one_error_line(err)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    code, _, err = _import_cli(tiny_gguf[1], tmp_path / "file", capsys)
    assert code == 2 and "not a directory" in _one_error_line(err)


# What a bad file holds (None: there is no file; "half": the first half of a good one).
BAD_FILES: dict[str, tuple[bytes | str | None, str]] = {
    "missing": (None, "no such file"),
    "empty": (b"", "not a GGUF file"),
    "zip": (b"PK\x03\x04" + bytes(4000), "not a GGUF file"),
    "garbage-header": (b"GGUF" + struct.pack("<I", 3) + b"\xff" * 64, "not a valid GGUF file"),
    "unknown-version": (b"GGUF" + struct.pack("<I", 99) + bytes(64), "not a valid GGUF file"),
    "truncated": ("half", "x.gguf"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_file_is_one_line_and_leaves_nothing(
    case: str, tiny_gguf: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, says = BAD_FILES[case]
    src = tmp_path / "x.gguf"
    if content == "half":
        content = tiny_gguf[1].read_bytes()[: tiny_gguf[1].stat().st_size // 2]
    if isinstance(content, bytes):
        src.write_bytes(content)
    code, _, err = _import_cli(src, tmp_path / "out", capsys)
    assert code == 2 and says in _one_error_line(err)
    assert [p.name for p in tmp_path.iterdir()] == ([] if content is None else ["x.gguf"])


def test_an_architecture_transformers_cannot_load_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "nonesuch")
    w.add_tensor("x.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, _, err = _import_cli(tmp_path / "odd.gguf", tmp_path / "out", capsys)
    assert code == 2 and "architecture 'nonesuch'" in _one_error_line(err)


def test_weights_larger_than_memory_are_refused_before_loading(
    tiny_gguf: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gguf_import, "available_memory_bytes", lambda: 1 << 20)  # 1 MiB free
    monkeypatch.setattr(gguf_import, "_load", lambda *a: pytest.fail("loaded a file that cannot fit"))
    with pytest.raises(GgufImportError, match=r"declares 836,736 weights: .* more than 50% of the 0.0 GiB"):
        import_gguf(tiny_gguf[1], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_mutated_headers_import_or_fail_in_one_line(tiny_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    """Hostile bytes in the header and metadata (the part a parser trusts): every mutant either
    imports or raises GgufImportError; no other exception, no directory left half written."""
    data = tiny_gguf[1].read_bytes()
    header_end = data.index(b"blk.0.") + 64  # metadata, then the first tensor infos
    rng = np.random.default_rng(0)
    outcomes = {"imported": 0, "refused": 0}
    for i in range(24):
        mutant = bytearray(data)
        for pos in rng.integers(4, header_end, size=int(rng.integers(1, 4))):
            mutant[int(pos)] = int(rng.integers(0, 256))
        path = tmp_path / f"m{i}.gguf"
        path.write_bytes(bytes(mutant))
        try:
            import_gguf(path, tmp_path / f"out{i}")
            outcomes["imported"] += 1
        except GgufImportError:
            outcomes["refused"] += 1
            assert not (tmp_path / f"out{i}").exists()
        path.unlink()
    assert outcomes["refused"] > 0, outcomes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
