"""docs/wire.md's test vectors and numbers, recomputed from the code.

The vectors are read out of the document itself, so the document cannot drift from the code
without this failing: a stranger implements from the text, not from this file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from echo_node.ml.tasks import get_task
from echo_node.net.p2p import provider_key
from protocol import Identity, SamplingParams, StatusRequest, VersionAnnounce, encode_message, seal
from protocol._wire import pack, unpack_strict
from protocol.assignment import Slot, batch_seed, prompt_draw
from protocol.framing import decode_frame, encode_length_prefixed
from protocol.identity import peer_id_from_public_key
from protocol.messages import SCHEMA_VERSION, RunSpec, Sample
from protocol.weights.manifest import build_manifest

DOC = (Path(__file__).resolve().parents[2] / "docs" / "wire.md").read_text()
SEED = bytes(range(32))


def section(number: int) -> str:
    """The text of `## <number>.` up to the next top-level section."""
    match = re.search(rf"^## {number}\. .*?(?=^## |\Z)", DOC, re.S | re.M)
    assert match is not None, f"docs/wire.md has no section {number}"
    return match.group(0)


def hex_of(text: str) -> bytes:
    """Bytes written as hex groups separated by spaces ("94 92 05 07 ...")."""
    return bytes.fromhex("".join(text.split()))


def after(label: str, text: str, pattern: str = r"[0-9a-f]+") -> str:
    match = re.search(rf"{re.escape(label)}\s*`?({pattern})`?", text)
    assert match is not None, f"no {label!r} in the document"
    return match.group(1)


def test_every_schema_number_is_the_codes() -> None:
    stated = [int(n) for n in re.findall(r"SCHEMA_VERSION(?:` \| | = )(\d+)", DOC)]
    stated += [int(n) for n in re.findall(r"it must equal (\d+)", DOC)]
    stated += [int(n) for n in re.findall(r"\| schema \| int \| (\d+)", DOC)]
    assert len(stated) >= 4, stated
    assert set(stated) == {SCHEMA_VERSION}
    # History in the prose ("schema 6") reads as the current number to a stranger: none left.
    assert re.findall(r"\(schema \d+", DOC) == []


def test_identity_vector() -> None:
    identity = Identity.from_seed(SEED)
    text = section(3)
    assert identity.public_key.hex() == after("public key", text)
    assert identity.peer_id == after("peer id", text, r"12D3KooW\w+")
    assert peer_id_from_public_key(identity.public_key) == identity.peer_id


def test_provider_key_vector() -> None:
    assert provider_key("demo") == after("run id `demo` → key", section(4))


def test_envelope_vector() -> None:
    text = section(6)
    message = VersionAnnounce(run_id="demo", version=1, size=1000, sha256=bytes(32), demand_groups=8, epoch=1)
    schema, kind, payload, public_key, signature = unpack_strict(decode_frame(seal(message, Identity.from_seed(SEED))), what="test")
    assert (schema, kind, public_key) == (SCHEMA_VERSION, "version_announce", Identity.from_seed(SEED).public_key)
    written = re.search(r"payload\s+= (.*)\n", text)
    assert written is not None
    # "c4 20 00…00 (32 bytes)": the 32 zero bytes are elided in the document.
    head, _, tail = written.group(1).partition("00…00 (32 bytes)")
    assert payload == hex_of(head) + bytes(32) + hex_of(tail)
    written_input = re.search(r"input\s+= (.*) \|\| payload", text)
    assert written_input is not None
    assert hex_of(written_input.group(1)) == b"echo-node/v1\x00" + kind.encode() + b"\x00"
    written_sig = re.search(r"signature = ([0-9a-f]+)\s+([0-9a-f]+)", text)
    assert written_sig is not None
    assert signature.hex() == written_sig.group(1) + written_sig.group(2)


def test_canonical_msgpack_vectors() -> None:
    text = section(7)
    sample = Sample(completion_ids=(5, 7), behaviour_logprobs=(-0.5, -1.0), token_versions=(3, 3), reward=1.0)
    written = re.search(r"reward=1\.0\)` →\s+([0-9a-f ]+)\n", text)
    assert written is not None
    assert pack(sample.to_wire()) == hex_of(written.group(1))
    assert pack(200) == hex_of("cc c8") and pack(-200) == hex_of("d1 ff 38")
    spec = RunSpec(
        run_id="demo", model={"b": 1, "a": 2.0, "n": {"z": [1, 2], "y": None}}, tokenizer={}, task="addition",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8), sync_mode="pull", staleness=0,
        group_size=2, current_version=0, learner_peer_id=Identity.from_seed(SEED).peer_id, epoch=0,
    )
    written_map = re.search(r"2\.0, \"n\": \{\"z\": \[1, 2\], \"y\": None\}\}` →\n`([0-9a-f ]+)`", text)
    assert written_map is not None
    assert pack(spec.to_wire()[1]) == hex_of(written_map.group(1))


def test_stream_frame_vector() -> None:
    written = re.search(r"is the frame\n\n\s+([0-9a-f ]+)\n", section(8))
    assert written is not None
    assert encode_length_prefixed(encode_message(StatusRequest(run_id="demo"))) == hex_of(written.group(1))


def test_prompt_assignment_vector() -> None:
    text = section(9)
    run = after("Test vector: run", text, r"[\w-]+")
    peer = after("publisher", text, r"12D3KooW\w+")
    seq, index = (int(after(f"{name} =", text, r"\d+")) for name in ("seq", "index"))
    draw = prompt_draw(run, peer, seq, index)
    assert Slot(run, peer, seq, index).digest().hex() == after("index = 2: digest", text)
    assert draw == int(after("draw", text, r"\d+"))
    assert get_task("addition").prompt_for(draw) == after("prompt", text, r"[\d+=]+")
    assert batch_seed(run, peer, seq) == int(after("that batch's seed is", text, r"\d+"))


def test_manifest_vector() -> None:
    text = section(10)
    manifest = build_manifest(run_id="demo", version=1, payload=bytes(20_000), piece_size=16_384)
    assert manifest.payload_sha256.hex() == after("payload_sha256 =", text)
    assert [p.hex() for p in manifest.pieces] == [after(f"pieces[{i}]      =", text) for i in range(2)]


@pytest.mark.parametrize("number", range(1, 16))
def test_sections_are_numbered_in_order(number: int) -> None:
    assert section(number).startswith(f"## {number}. ")


def test_the_repair_rules_numbers_are_the_codes() -> None:
    """What a publisher must keep, and what leaving seqs out costs, as § 8 and § 15 state them."""
    from echo_node.learner.intake import DISOWN_ALLOWANCE, DISOWN_HORIZON, SKIP_ALLOWANCE, SKIP_SHARE
    from protocol.limits import REPAIR_KEEP

    rule = section(8)
    assert f"at least its last {REPAIR_KEEP} published frames (`REPAIR_KEEP`)" in rule
    assert f"less than {DISOWN_HORIZON} below the highest seq" in rule
    assert (f"more than {SKIP_ALLOWANCE} + {SKIP_SHARE:.0%} of its own seqs".replace("%", " %")
            + f" (their prompts were assigned to it), or disowning more than {DISOWN_ALLOWANCE}") in section(15)


def test_the_data_channels_constants_are_the_codes() -> None:
    """Every row of the constants table that names echo_node/weights/broadcast.py states its
    values as the code has them."""
    from echo_node.weights import broadcast

    rows = re.findall(r"^\| (`[A-Z_]+`(?: / `[A-Z_]+`)*) \| ([^|]+) \| broadcast\.py \|$", DOC, re.MULTILINE)
    assert len(rows) >= 3
    for names, values in rows:
        for name, value in zip(re.findall(r"`([A-Z_]+)`", names), values.split(" / "), strict=True):
            assert getattr(broadcast, name) == float(value.replace(",", "")), name


def test_what_an_unproven_peer_gets_is_the_codes() -> None:
    """§ 14's paragraph on unproven peers states the learner's numbers as the code has them."""
    from echo_node.config import VerifyConfig
    from echo_node.learner.spot_check import NOISE_TRUST, UNPROVEN_ROWS

    cfg = VerifyConfig()
    rule = " ".join(section(14).split())
    assert f"until {cfg.trust_tokens:,} of a peer's tokens passed checks ({cfg.trust_tokens // NOISE_TRUST:,} once" in rule
    assert f"every row up to {UNPROVEN_ROWS}" in rule
    assert cfg.unproven_share == 0.25 and "a quarter of the step's slots" in rule
