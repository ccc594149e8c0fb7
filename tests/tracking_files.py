"""Read experiment-tracking files back with the libraries that wrote them (the tests' side of
echo_node/learner/tracking.py)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from every event file under `directory` (later files win a step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


# A W&B run file (run-*.wandb) is a log of protobuf `Record`s in 32 KiB blocks, each chunk with a
# 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last), after a 7-byte file
# header that starts with ":W&B". wandb itself no longer ships a reader for it.
_BLOCK = 32 * 1024


def _wandb_chunks(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        chunk, pos = data[pos:pos + length], pos + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def wandb_history(directory: Path) -> list[dict[str, object]]:
    """Every history row (what `run.log` sent) of the W&B run files under `directory`."""
    from wandb.proto import wandb_internal_pb2

    rows: list[dict[str, object]] = []
    for path in sorted(directory.rglob("run-*.wandb")):
        for chunk in _wandb_chunks(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows
