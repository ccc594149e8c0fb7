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
