"""The shared benchmark harness: round-robin timing in shuffled orders."""

from collections import Counter

from cocosync.bench.common import time_interleaved


def test_time_interleaved_shuffles_so_every_case_follows_every_other():
    calls: list[str] = []
    cases = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    samples = time_interleaved(cases, 60, warmup=2)
    assert {k: len(v) for k, v in samples.items()} == {"a": 60, "b": 60, "c": 60}
    assert all(t >= 0 for v in samples.values() for t in v)
    rounds = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert rounds[0] == list("abc") and all(sorted(r) == list("abc") for r in rounds)
    assert len({"".join(r) for r in rounds}) == 6  # every order occurs
    follows = {(calls[i - 1], calls[i]) for i in range(1, len(calls))}
    assert {(x, y) for x in "abc" for y in "abc" if x != y} <= follows
    after_c = Counter(calls[i] for i in range(1, len(calls)) if calls[i - 1] == "c")
    assert min(after_c["a"], after_c["b"]) > 0.25 * sum(after_c.values()), after_c  # not always the same one
    calls2: list[str] = []
    time_interleaved({k: (lambda k=k: calls2.append(k)) for k in "abc"}, 60, warmup=2)
    assert calls2 == calls  # the same order on every rank (a fixed seed)
