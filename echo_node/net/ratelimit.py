"""Token buckets for requests peers may send at will. Pure: handed `now`, never reads a clock.

Rule: a bucket holds at most `burst` tokens and gains `rate` per second; a request takes one or
is refused. `RateLimits` keeps one bucket per key, at most `max_keys` (the least recently used is
forgotten: it comes back full, which costs at most one burst).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    rate: float
    burst: float
    tokens: float
    stamp: float

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class RateLimits:
    def __init__(self, rate: float, burst: float, *, max_keys: int) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, key: str, now: float) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, self.burst, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(key)
        return bucket.take(now)


# Joins the learner takes: per identity (a re-join after an outage is normal, a loop is not), per
# source address (one machine's identities together) and in all (rate, burst). Each join may cost
# a dial-back and a journal record; these keep that well under what one core spends on training.
JOINS_PER_PEER = (0.5, 4.0)
JOINS_PER_SOURCE = (2.0, 16.0)
JOINS_ALL = (20.0, 64.0)
# Keys kept per table, least recently used forgotten (it comes back with a full burst).
MAX_JOIN_KEYS = 8192


class JoinLimits:
    """The three join budgets; `take` spends one of each, or refuses at the first one empty."""

    def __init__(self) -> None:
        self._peer = RateLimits(*JOINS_PER_PEER, max_keys=MAX_JOIN_KEYS)
        self._source = RateLimits(*JOINS_PER_SOURCE, max_keys=MAX_JOIN_KEYS)
        self._all = TokenBucket(JOINS_ALL[0], JOINS_ALL[1], JOINS_ALL[1], -float("inf"))

    def take(self, now: float, peer: str, source: str) -> bool:
        return self._peer.take(peer, now) and self._source.take(source, now) and self._all.take(now)


class RecentlySeen:
    """Keys seen within `window_s`, at most `max_keys` of them (the oldest forgotten first)."""

    def __init__(self, window_s: float, max_keys: int) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._seen: OrderedDict[object, float] = OrderedDict()

    def fresh(self, key: object, now: float) -> bool:
        """True (and remember `key` from now) if it was not seen within the window."""
        at = self._seen.get(key)
        if at is not None and now - at < self.window_s:
            return False
        self._seen[key] = now
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        return True
