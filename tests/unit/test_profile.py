"""The learner's profile (echo_node/learner/profile.py): stages timed on the loop and in worker threads."""

from __future__ import annotations

import threading
import time

from echo_node.learner.profile import Profile


def busy(seconds: float) -> int:
    end, n = time.thread_time() + seconds, 0
    while time.thread_time() < end:
        n += 1
    return n


def test_stages_count_wall_and_the_cpu_of_the_thread_that_ran_them() -> None:
    p = Profile()
    with p.stage("loop"):
        busy(0.05)
        time.sleep(0.05)  # wall, not CPU
    work = p.timed("worker", busy)
    t = threading.Thread(target=work, args=(0.05,))
    t.start()
    with p.stage("waiting"):  # the loop awaiting a worker thread spends no CPU of its own
        t.join()
    out = p.to_dict(extra_cpu={"elsewhere": 0.01})
    s = out["stages"]
    assert s["loop"]["calls"] == 1 and s["loop"]["wall_s"] >= 0.1 and 0.04 <= s["loop"]["cpu_s"] < 0.09
    assert 0.04 <= s["worker"]["cpu_s"] and s["waiting"]["cpu_s"] < 0.02 <= s["waiting"]["wall_s"]
    assert s["elsewhere"]["cpu_s"] == 0.01 and abs(s["elsewhere"]["cpu_share"] - 0.01 / out["cpu_s"]) < 0.01
    assert all(0 <= v["wall_share"] <= 1 for k, v in s.items() if k != "elsewhere")
    assert list(s)[:1] == ["loop"], "stages by wall time, largest first"
