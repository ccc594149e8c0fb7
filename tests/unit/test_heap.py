"""The learner's heap setting (echo_node/learner/heap.py), in child processes: it is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Under glibc's defaults, freeing a 16 MiB block raises the mmap threshold to 16 MiB, so 1 MiB
# blocks come from the arena, and 63 MiB of them freed below one still in use stay resident.
PROBE = """
import sys
if sys.argv[1] == "limit":
    from echo_node.learner.heap import limit_heap_growth
    print(limit_heap_growth())
def anon():
    return int([l for l in open('/proc/self/status') if l.startswith('RssAnon')][0].split()[1])
def touched(n):
    b = bytearray(n)
    b[::4096] = b'x' * len(b[::4096])
    return b
big = touched(16 << 20)
del big
base = anon()
blocks = [touched(1 << 20) for _ in range(64)]
last = blocks[-1]
del blocks
print((anon() - base) // 1024)
"""


def probe(mode: str, **env: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=60,
                         env={**os.environ, **env}).stdout
    return out.splitlines()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux")
def test_a_learner_returns_freed_blocks_to_the_kernel() -> None:
    said, held = probe("limit")
    assert said == "heap: blocks of 256 KiB and more are returned to the kernel when freed"
    assert int(held) <= 4, f"{held} MiB still resident after freeing 63 MiB"
    (without,) = probe("default")
    assert int(without) >= 60, "glibc's defaults keep the freed blocks: the probe shows the difference"


def test_the_operators_environment_wins() -> None:
    said, _ = probe("limit", MALLOC_MMAP_THRESHOLD_="1048576")
    assert said == "heap: MALLOC_MMAP_THRESHOLD_=1048576 (set by the environment)"
