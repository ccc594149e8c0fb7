"""Which work a rollout peer owes: the prompt and the sampling seed of every group it publishes.

Job: a peer must not choose its prompts (cherry-picking easy ones, or posing its own), so the
prompt of each group is drawn by a rule anyone can recompute from what the signed batch already
says; the learner recomputes it and refuses a group whose prompt differs (`bad_prompt`).

Rule (schema 9). A group's *slot* is (run id, publisher peer id, seq, index):
- seq: the `RolloutBatch.seq` it travels in; index: its position in that batch's groups.
The slot's digest is SHA-256 over DOMAIN and the four fields, each length-prefixed (strings as
UTF-8, integers as 8-byte big-endian). Its first 8 bytes, big-endian, are the *prompt draw*,
which the run's task maps to a prompt (`Task.prompt_for`); the learner encodes that prompt as
the run encodes prompts and compares ids. The batch's sampling seed is drawn the same way with
index SEED_INDEX (one seed per engine call; the learner cannot check a seed, it is fixed so a
peer's run is reproducible, not chosen).

The version a group began on (the version tag of every sample's first token; a first token is
sampled by the prefill, before any mid-generation weight swap, so all samples of an honest group
share it) is not part of the slot. A peer may begin a batch on any admissible version (S + 1 of
them in async mode), and were the version in the slot that would be S + 1 prompts to choose
from per seq: the easiest of five at S = 4. A seq owes one fixed sequence of prompts and one
seed whatever the version, so a publisher can choose its prompts only by leaving a seq
unpublished (a gap the learner sees and counts). A peer therefore generates each batch for the
seq it will publish it under, and a batch must fit one message (`groups_that_fit`).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Final

from protocol.limits import MAX_BATCH_GROUPS, ROLLOUT_BATCH_BYTES

__all__ = ["DOMAIN", "SEED_INDEX", "Slot", "batch_seed", "group_version", "groups_that_fit", "prompt_draw"]

DOMAIN: Final = b"echo-node/assignment/v2"
SEED_INDEX: Final = 2**63 - 1  # never a group index (a batch holds at most MAX_BATCH_GROUPS)
_U64 = struct.Struct(">Q")


@dataclass(frozen=True, slots=True)
class Slot:
    run_id: str
    peer_id: str
    seq: int
    index: int

    def digest(self) -> bytes:
        h = hashlib.sha256()
        for part in (DOMAIN, self.run_id.encode(), self.peer_id.encode()):
            h.update(_U64.pack(len(part)))
            h.update(part)
        for n in (self.seq, self.index):
            if not 0 <= n < 2**64:
                raise ValueError(f"slot fields must be in [0, 2**64), got {n}")
            h.update(_U64.pack(n))
        return h.digest()


def prompt_draw(run_id: str, peer_id: str, seq: int, index: int) -> int:
    """The 64-bit draw the task turns into the prompt of group `index` of batch `seq`."""
    return int.from_bytes(Slot(run_id, peer_id, seq, index).digest()[:8], "big")


def batch_seed(run_id: str, peer_id: str, seq: int) -> int:
    """The sampling seed (31 bits, what engines take) of the batch published under `seq`."""
    return int.from_bytes(Slot(run_id, peer_id, seq, SEED_INDEX).digest()[:4], "big") >> 1


def group_version(first_versions: list[int]) -> int | None:
    """The version a group began on, from its samples' first-token tags (empty samples left
    out), or None when they disagree: no honest engine starts one group on two versions."""
    versions = set(first_versions)
    return versions.pop() if len(versions) == 1 else None


def groups_that_fit(worst_group_bytes: int) -> int:
    """How many groups of at most `worst_group_bytes` (encoded) one rollout batch always holds:
    a peer generates no more per batch, so a batch is one message and its slots are known
    before it is sampled."""
    return max(1, min(MAX_BATCH_GROUPS, ROLLOUT_BATCH_BYTES // max(1, worst_group_bytes)))
