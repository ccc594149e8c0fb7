"""The protocol's exception hierarchy.

Job: name who is at fault when bytes or objects break the protocol, in the style of h11.

- `RemoteProtocolError`: a peer sent something bad. The node counts it (with a `DropReason`),
  may penalize the peer, and carries on; it must never crash the node.
- `LocalProtocolError`: our own code tried to build or send something invalid. That is a bug
  (or a configuration error) on this side, so it should surface loudly.

Invariant: every failure raised by `protocol/` on untrusted input is a `RemoteProtocolError`;
no other exception type escapes a decoder fed hostile bytes.
"""

from __future__ import annotations

from protocol.drops import DropReason

__all__ = ["LocalProtocolError", "ProtocolError", "RemoteProtocolError"]


class ProtocolError(Exception):
    """Base class of everything `protocol/` raises about protocol violations."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something that breaks the protocol.

    `reason` is the drop reason to count the offending message under, so the caller can account
    for every rejected message without parsing error strings.
    """

    def __init__(self, message: str, *, reason: DropReason = DropReason.MALFORMED) -> None:
        super().__init__(message)
        self.reason: DropReason = reason


class LocalProtocolError(ProtocolError):
    """We tried to build or send something the protocol does not allow."""
