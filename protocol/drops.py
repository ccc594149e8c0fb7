"""Why a message was dropped.

Job: one closed vocabulary of drop reasons, shared by decoders (which attach a reason to every
`RemoteProtocolError`) and by the learner's accounting. The invariant it serves (prime-rl style):
every rollout that reaches the learner is counted exactly once, as trained or as dropped with one
of these reasons.

Values are stable strings: they appear in metrics and logs, so renaming one is a breaking change.
"""

from __future__ import annotations

import enum

__all__ = ["DropReason"]


class DropReason(enum.StrEnum):
    """A counted reason for dropping a message (a `str`, so it formats as its value)."""

    STALE = "stale"  # older than the staleness rule admits (Echo §3: version < current - S)
    FUTURE_VERSION = "future_version"  # claims a policy version above the learner's current one
    UNPUBLISHED_VERSION = "unpublished_version"  # claims a version number the learner never published
    WRONG_RUN = "wrong_run"  # well-formed, but for another run id
    BAD_SIGNATURE = "bad_signature"  # signature or public key does not verify
    WRONG_SENDER = "wrong_sender"  # valid signature, but not by whom the message claims / we expect
    MALFORMED = "malformed"  # undecodable, out of bounds, wrong types, non-canonical encoding
    UNSUPPORTED_SCHEMA = "unsupported_schema"  # a schema version this node does not speak
    DUPLICATE = "duplicate"  # a (publisher, seq) already seen
    TOO_OLD = "too_old"  # a seq below the tracking window: cannot tell whether it is a duplicate
    BAD_GROUP = "bad_group"  # group shape does not match the run spec (e.g. wrong group size)
    OUT_OF_VOCAB = "out_of_vocab"  # a token id the run's model has no embedding for
    TOO_LONG = "too_long"  # a completion or prompt longer than the run samples
    BAD_REWARD = "bad_reward"  # a reward outside the task's range, or not the one its completion earns
    BAD_PROMPT = "bad_prompt"  # not the prompt the group's slot assigns (protocol/assignment.py)
    BAD_COMPLETION = "bad_completion"  # tokens after eos: unscored text no engine samples
    BAD_LOGPROBS = "bad_logprobs"  # behaviour log-probs the claimed versions do not give
    BAD_SAMPLING = "bad_sampling"  # tokens not sampled at the run's temperature (improbable, greedy)
    UNCHECKED = "unchecked"  # an unproven publisher's batch the learner's checker had no room for (never trained unchecked)
    COPIED = "copied"  # a group another publisher sent first (same prompt, same samples)
    NOT_JOINED = "not_joined"  # the publisher never joined the run (or was evicted from it)
    BANNED = "banned"  # the publisher is banned for earlier bad messages
    OVERLOAD = "overload"  # the receiver had no room (buffer full, rate limit)
    PURGED = "purged"  # admitted, then removed when its publisher was caught cheating
    TRAIN_ERROR = "train_error"  # admitted, but the training step on its batch failed
    NO_SIGNAL = "no_signal"  # admitted, but no group of its batch had reward variance: nothing to train
    UNUSED_AT_EXIT = "unused_at_exit"  # admitted, but still buffered when the learner stopped
    BAD_EPISODE = "bad_episode"  # an observation or reward the environment, re-run on the actions, does not give
    ENV_FAILED = "env_failed"  # the learner's re-run of the environment raised or answered malformed (nobody's fault)
    ENV_TIMEOUT = "env_timeout"  # the learner's re-run of the environment overran its time (nobody's fault)
    ENV_UNAVAILABLE = "env_unavailable"  # not re-run: the learner's environment threads are hung, or the publisher's last re-runs hung it
