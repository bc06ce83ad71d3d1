"""Random-interleaving model of lcsf's copying producer (ab/decode-copy.patch): no deadlock, no stage read before
its copies are signalled, no slot rewritten before the consumer frees it.

The producer issues stage n's copies into slot n % S once the slot is free (the consumer freed stage n - S), and
signals stage n - L full once it has issued stage n (its copies are then done: at most L newer groups in flight);
after its last stage it signals the rest. The consumer (release lag 1) computes stage n once it is signalled and
then frees stage n - 1; after a task's last stage it frees that one too. Tasks have random stage counts (0 too).

    python3 ab/copy_lag_model.py     # exits 1 with the failing case if the protocol breaks
"""
from __future__ import annotations

import random
import sys


def run(stages: int, lag: int, iters: list[int], rng: random.Random) -> str | None:
    total = sum(iters)
    ends = set()  # global indices of each task's last stage
    n = 0
    for k in iters:
        n += k
        if k:
            ends.add(n - 1)
    issued = signalled = computed = 0  # counts of stages
    freed = [False] * total
    held = None  # the consumer's previous stage (release lag 1)
    in_slot = {}  # slot -> stage whose data it holds
    flushed = False
    for _ in range(100 * (total + 10)):
        moves = []
        if issued < total and (issued < stages or freed[issued - stages]):
            moves.append("issue")
        if issued == total and not flushed:
            moves.append("flush")
        if computed < signalled:
            moves.append("compute")
        if not moves:
            if computed == total:
                return None
            return f"deadlock: issued {issued} signalled {signalled} computed {computed} of {total}"
        move = rng.choice(moves)
        if move == "issue":
            slot = issued % stages
            if slot in in_slot and not freed[in_slot[slot]]:
                return f"slot {slot} rewritten while stage {in_slot[slot]} is held"
            in_slot[slot] = issued
            issued += 1
            if issued - signalled > lag:  # L + 1 groups out: the oldest is done
                signalled += 1
        elif move == "flush":
            signalled, flushed = issued, True
        else:
            s = computed
            if s >= signalled:
                return f"stage {s} read before it was signalled"
            computed += 1
            if held is not None:
                freed[held] = True
            held = s
            if s in ends:  # the task's drain and finish: its last stage goes back too
                freed[s] = True
                held = None
    return "no progress bound reached"


def main() -> int:
    rng = random.Random(0)
    cases = 0
    for stages in range(2, 9):
        for lag in range(1, stages - 1):
            for _ in range(300):
                iters = [rng.choice([0, 1, 2, 3, 5, 8, 17]) for _ in range(rng.randint(1, 6))]
                err = run(stages, lag, iters, rng)
                cases += 1
                if err:
                    print(f"stages {stages} lag {lag} iters {iters}: {err}")
                    return 1
    # The bound is tight: lag = stages - 1 deadlocks.
    bad = run(4, 3, [10], random.Random(1))
    print(f"{cases} interleavings passed; lag = stages - 1: {bad}")
    return 0 if bad and bad.startswith("deadlock") else 1


if __name__ == "__main__":
    sys.exit(main())
