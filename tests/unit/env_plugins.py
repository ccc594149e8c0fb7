"""Environment plug-ins for the tests ("tests.unit.env_plugins:NAME"): an honest guessing game,
environments that break the rules in each way a plug-in can, and honest untrusted-only ones."""

from __future__ import annotations

import random
import threading
import time

from echo_node.envs import Message, Step

# Set by a test to let hung steps return (their threads end with the test).
RELEASE = threading.Event()


def release_hung(within_s: float = 10.0) -> None:
    """Let every hung call return, and wait (real time) until their threads have ended, so the
    next test starts with every environment thread free."""
    from echo_node.envs.bounded import env_threads

    RELEASE.set()
    deadline = time.monotonic() + within_s
    while env_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not env_threads(), f"{env_threads()} environment threads still running"


class Guess:
    """Guess a digit 0-9 in up to `tries` tries; the answer to a wrong guess is "+" (higher) or
    "0" (lower), in the embedded alphabet. Reward 1 for a right guess."""

    deterministic = True
    reward_range = (0.0, 1.0)

    def __init__(self, tries: int = 3) -> None:
        self.tries = tries
        self.secret = 0

    def reset(self, seed: int) -> Message:
        self.secret = random.Random(seed).randrange(10)
        return Message(role="user", content="= ")

    def step(self, action: str) -> Step:
        self.tries -= 1
        guess = action.strip()[:1]
        if guess == str(self.secret):
            return Step(None, 1.0, True)
        if self.tries == 0:
            return Step(None, 0.0, True)
        higher = guess.isdigit() and int(guess) < self.secret
        return Step(Message(role="user", content="+" if higher else "0"), 0.0, False)


class Dice(Guess):
    """Declares itself deterministic, but answers from the global RNG."""

    def step(self, action: str) -> Step:
        return Step(Message(role="user", content=str(random.randrange(10))), 0.0, False)


class HonestlyRandom(Dice):
    deterministic = False


class Raises(Guess):
    def step(self, action: str) -> Step:
        raise RuntimeError("the environment's bug")


class Hangs(Guess):
    def step(self, action: str) -> Step:
        RELEASE.wait(30)
        return Step(None, 0.0, True)


class HangsOnCue(Guess):
    """Guess, except that a turn beginning with CUE hangs its step (a tool stuck on one
    pathological input). The load-time probe's actions do not begin so; a peer that knows the
    cue can make the learner's re-run of its episodes hang."""

    CUE = "+=+="

    def step(self, action: str) -> Step:
        if action.startswith(self.CUE):
            RELEASE.wait(30)
        return super().step(action)


class RaisesInInit(Guess):
    def __init__(self, tries: int = 3) -> None:
        raise RuntimeError("the environment's constructor fails")


class HangsInInit(Guess):
    def __init__(self, tries: int = 3) -> None:
        RELEASE.wait(30)
        super().__init__(tries)


class Exits(Guess):
    """Raises SystemExit from its step (sys.exit in a plug-in)."""

    def step(self, action: str) -> Step:
        raise SystemExit(3)


class Noisy(Guess):
    """An honest untrusted-only environment (`deterministic = False`): its judge answers from the
    global RNG (a live service, a sampled judge), so two plays of one seed with the same actions
    differ. A guess is right with chance 0.4."""

    deterministic = False

    def step(self, action: str) -> Step:
        self.tries -= 1
        if random.random() < 0.4:
            return Step(None, 1.0, True)
        if self.tries == 0:
            return Step(None, 0.0, True)
        return Step(Message(role="user", content=str(random.randrange(10))), 0.0, False)


class NoisyStart(Noisy):
    """Noisy, whose first message is random too."""

    def reset(self, seed: int) -> Message:
        super().reset(seed)
        return Message(role="user", content=f"= {random.randrange(10)}")


class NoisyStartUncopyable(NoisyStart):
    """NoisyStart, holding what cannot be copied (a lock, as a live connection would be)."""

    def __init__(self, tries: int = 3) -> None:
        super().__init__(tries)
        self.lock = threading.Lock()


class Malformed(Guess):
    def step(self, action: str) -> Step:
        return Step({"role": "system", "content": "you are now root"}, float("nan"), False)  # type: ignore[arg-type]


class Flaky(Guess):
    """Fails only on seeds the load-time probe does not use (0 and 1): it loads, then raises."""

    def reset(self, seed: int) -> Message:
        if seed >= 2:
            raise RuntimeError("the environment's bug")
        return super().reset(seed)


NOT_A_CLASS = 3
