"""Every bound the protocol enforces, in one place.

Job: name each limit and say where it comes from, so decoders never accept unbounded input and a
reviewer can audit all bounds at once (h11 style). Changing a bound that narrows what is accepted
is a wire-compatibility change: bump `messages.SCHEMA_VERSION` with it.

Invariant: a decoder fed at most `MAX_FRAME_BYTES` (gossip) or `MAX_MESSAGE_BYTES` (streams)
allocates O(that) memory, whatever the bytes are.
"""

from __future__ import annotations

import re
from typing import Final

# --- Framing ---------------------------------------------------------------------------------

# Compressed size of one gossip frame. py-libp2p 0.8.1 silently drops gossip payloads above about
# 1,048,000 B (docs/platform.md); rollouts stay far below that so a frame plus gossip overhead
# never gets near the cliff, and so one message cannot monopolize a 32-message subscription queue.
MAX_FRAME_BYTES: Final = 256 * 1024

# Decompressed size of one frame. Caps what a zstd bomb can make us allocate (16x the frame bound;
# real rollout frames compress ~2-4x, token ids and float64 log-probs are not very redundant).
MAX_DECOMPRESSED_BYTES: Final = 4 * 1024 * 1024

# A sealed message (signed envelope, before compression) is at most one frame's worth: every
# sealed kind fits (a rollout batch's groups are at most ROLLOUT_BATCH_BYTES, a manifest's
# digests at most MAX_PIECES * 34 B), and a gossip frame then costs at most this much msgpack
# to decode, however well it compresses.
MAX_SEALED_BYTES: Final = MAX_FRAME_BYTES

# One request/response message on an authenticated stream (uncompressed msgpack, length-prefixed).
# Same cap as a decompressed frame: a repair response carrying several sealed frames fits.
MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024

# The length prefix is 4 bytes big-endian, so nothing longer than this can be framed at all.
MAX_LENGTH_PREFIXED: Final = 2**32 - 1

# zstd window we accept. Our encoder compresses at most MAX_DECOMPRESSED_BYTES in one shot, for
# which zstd never picks a window above 4 MiB; refusing larger windows stops a tiny frame from
# making the streaming decoder reserve up to 2 GiB.
MAX_ZSTD_WINDOW: Final = 8 * 1024 * 1024

# --- Sequences and groups --------------------------------------------------------------------

# Tokens in one completion or one prompt. The embedded model and SmolLM2 use far fewer; a longer
# context should travel as several groups or wait for a schema bump.
MAX_TOKENS_PER_SEQUENCE: Final = 4096
MAX_PROMPT_TOKENS: Final = MAX_TOKENS_PER_SEQUENCE

# Completions per GRPO group (Echo / ECHO-2 use 8-16; 64 leaves room and bounds one message).
MIN_GROUP_SIZE: Final = 2  # GRPO's advantage is relative to the group: one sample has no baseline
MAX_GROUP_SIZE: Final = 64

# Token ids are < MAX_VOCAB. Largest vocabularies in use are ~256k (Gemma); 1M leaves headroom.
MAX_VOCAB: Final = 1_000_000

# |reward| bound: a finite but huge reward (1e308) overflows the group's variance to inf and turns
# every advantage into NaN; verifiable rewards are O(1).
MAX_ABS_REWARD: Final = 1e6

# Sampling temperature range; 0 means greedy.
MAX_TEMPERATURE: Final = 100.0

# --- Identifiers and strings -----------------------------------------------------------------

# Run ids become DHT keys, topic names and directory names: a conservative, path-safe charset.
MAX_RUN_ID_LEN: Final = 64
RUN_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # use with fullmatch

# Generic free-text bound (task descriptions, error messages, config strings).
MAX_STR: Final = 4096

# Short names: group ids, config keys, error codes.
MAX_NAME_LEN: Final = 128
ERROR_CODE_PATTERN: Final = re.compile(r"[a-z][a-z0-9_]{0,63}")  # use with fullmatch

# A libp2p peer id string. Ed25519 ids are 52 base58 characters; the bound only stops a hostile
# string from costing quadratic base58 decoding.
MAX_PEER_ID_LEN: Final = 128

# DNS names are at most 253 characters (RFC 1035); IPv6 literals are shorter.

# Generic list bound (also the largest msgpack array a decoder accepts).
MAX_LIST: Final = 4096
MAX_WIRE_ARRAY: Final = max(MAX_LIST, MAX_TOKENS_PER_SEQUENCE)
# Arrays in one decoded message, all levels together. A rollout batch (the most array-dense
# message) holds 4 per sample and at least ~24 encoded bytes per sample, so one filled to
# ROLLOUT_BATCH_BYTES has ~33k; a peers frame has 1025.
MAX_WIRE_ARRAYS: Final = 65536

# Model / tokenizer config dicts in the run spec: str keys; values are scalars, lists of scalars,
# or one level of nested dict (HF configs have e.g. `rope_scaling: {...}`).
MAX_CONFIG_KEYS: Final = 256  # per dict; also the largest msgpack map a decoder accepts
MAX_CONFIG_LIST: Final = 1024  # per list value (a character tokenizer's vocabulary fits)
MAX_CONFIG_ITEMS: Final = 4096  # values in one config, all levels together
MAX_CONFIG_DEPTH: Final = 2  # the top-level dict plus one nested level

# --- Integers --------------------------------------------------------------------------------

# Versions and sequence numbers fit a signed 64-bit integer so non-Python peers can hold them.
MAX_INT64: Final = 2**63 - 1
MIN_INT64: Final = -(2**63)
MAX_VERSION: Final = MAX_INT64
MAX_SEQ: Final = MAX_INT64

# Staleness bound S (Echo async mode). Echo/ECHO-2 use single digits; larger is almost certainly
# a typo, and S bounds how long the learner must accept a version.
MAX_STALENESS: Final = 65_535

# One weights blob (1 TiB): far beyond any model this system trains; keeps sizes int64-safe.
MAX_WEIGHTS_BYTES: Final = 1 << 40

# --- Crypto sizes (fixed by Ed25519 / SHA-256) -----------------------------------------------

ED25519_SEED_BYTES: Final = 32
ED25519_PUBLIC_KEY_BYTES: Final = 32
ED25519_SIGNATURE_BYTES: Final = 64
SHA256_BYTES: Final = 32

# --- Repair and gap tracking -----------------------------------------------------------------

# Seqs one repair request may ask for; a response fits in MAX_MESSAGE_BYTES only if the frames
# are small, so responders pack what fits (`pack_repair_response`) and requesters ask again.
MAX_REPAIR_SEQS: Final = 256

# A publisher answers repair for at least its last REPAIR_KEEP published seqs (wire.md § 8). A
# seq it lists as unavailable although the requester had seen a seq less than REPAIR_KEEP / 2
# above it was never published: the publisher *disowned* it (leaving out a slot it was assigned).
# The margin covers a publisher that ran ahead of what the requester has seen.
REPAIR_KEEP: Final = 512

# SequenceTracker: how far behind a publisher's highest seq we still detect duplicates and gaps
# (4096 bits of state per publisher), how many gaps we report per publisher, and how many
# publishers we track before evicting the least recently seen.
SEQ_WINDOW: Final = 4096
MAX_MISSING_PER_PEER: Final = MAX_REPAIR_SEQS
MAX_TRACKED_PUBLISHERS: Final = 10_000

# Rollout batches (one gossip message each): at most this many groups, and at most this many
# bytes of encoded groups, a quarter below MAX_FRAME_BYTES so that the sealed frame (signature,
# key, headers) fits a frame even where zstd gains nothing, and far below gossip's ~1 MB cliff.
MAX_BATCH_GROUPS: Final = 256
ROLLOUT_BATCH_BYTES: Final = 192 * 1024

# A learner asks each rollout peer for at most this many groups per weight version (flow
# control); far above any useful demand, it only bounds what a peer will plan for.
MAX_DEMAND_GROUPS: Final = 4096

# --- Weight dissemination (manifests and pieces) ---------------------------------------------

# Piece sizes are powers of two in [16 KiB, 4 MiB]. 64 KiB relay chunks beat 1 MiB ones (pipeline
# fill ~ N * chunk / rate, docs/platform.md), so small pieces must be possible; below 16 KiB the
# per-piece request and hash overhead dominates. 4 MiB keeps one piece plus its framing within
# what a peer buffers per request.
MIN_PIECE_SIZE: Final = 16 * 1024
MAX_PIECE_SIZE: Final = 4 * 1024 * 1024

# Pieces per manifest. A sealed manifest must fit one gossip frame (MAX_FRAME_BYTES = 256 KiB;
# SHA-256 digests do not compress: 4096 x 34 B = 136 KiB) and its digest list must fit one
# msgpack array a decoder accepts (MAX_WIRE_ARRAY). With 4 MiB pieces that is 16 GiB of payload;
# a 270 MB model (SmolLM2-135M in bf16) needs pieces of at least 128 KiB.
MAX_PIECES: Final = 4096

# A peer's claimed price per hour (StatusRequest): finite, and far above any machine's rent.
MAX_PRICE_PER_HOUR: Final = 1e6
