"""ResumableSampler: determinism, DP split, and resume from global samples consumed on any DP size."""

import pytest

from lit_lm.data.sampler import ResumableSampler


def global_stream(n: int, replicas: int, batch: int, passes: int, start: int = 0, seed: int = 0) -> list[int]:
    """Run `passes` passes on every rank and interleave the ranks' batches back into global order."""
    samplers = [ResumableSampler(n, batch, replicas, r, seed=seed, start=start) for r in range(replicas)]
    out = []
    for _ in range(passes):
        per_rank = [list(s) for s in samplers]
        for step in range(len(per_rank[0]) // batch):
            for r in range(replicas):
                out.extend(per_rank[r][step * batch: (step + 1) * batch])
    return out


def test_deterministic_from_seed():
    a = list(ResumableSampler(50, 5, seed=3))
    assert a == list(ResumableSampler(50, 5, seed=3))
    assert sorted(a) == list(range(50)) and a != list(range(50))
    assert list(ResumableSampler(50, 5, seed=4)) != a


def test_passes_walk_through_reshuffled_epochs():
    s = ResumableSampler(20, 4, seed=0)
    first, second = list(s), list(s)
    assert sorted(first) == sorted(second) == list(range(20)) and first != second
    s.set_epoch(7)  # Lightning's epoch counter does not move the stream
    assert s.start == 40


def test_ranks_run_equal_whole_batches():
    parts = [list(ResumableSampler(103, 4, 3, r, seed=1)) for r in range(3)]
    assert {len(p) for p in parts} == {32}  # 103 // (4·3) = 8 batches of 4 on every rank
    assert len({i for p in parts for i in p}) == 96


def test_global_batches_do_not_depend_on_dp_size():
    """The samples of global step s are the same set whatever the number of ranks (global batch fixed)."""
    one = global_stream(96, 8, 1, passes=2)
    two = global_stream(96, 4, 2, passes=2)
    four = global_stream(96, 2, 4, passes=2)
    assert len(one) == len(two) == len(four) == 192
    for s in range(24):
        window = slice(8 * s, 8 * (s + 1))
        assert sorted(one[window]) == sorted(two[window]) == sorted(four[window])


@pytest.mark.parametrize("replicas_after", [1, 2, 3])
def test_resume_continues_the_stream_on_any_dp_size(replicas_after):
    """Stop after 5 global batches of 6 on 2 ranks, resume on any number of ranks: the continuation is the
    uninterrupted stream, across the epoch boundary too."""
    full = global_stream(40, 6, 1, passes=3)
    consumed = 30
    batch = 6 // replicas_after
    resumed = global_stream(40, batch, replicas_after, passes=1, start=consumed)
    for s in range(len(resumed) // 6):
        assert sorted(resumed[6 * s: 6 * (s + 1)]) == sorted(full[consumed + 6 * s: consumed + 6 * (s + 1)])


def test_validation_sampler_repeats_the_same_samples():
    s = ResumableSampler(10, 2, 2, 1, shuffle=False, advance=False)
    assert list(s) == list(s) == [1, 3, 5, 7]
