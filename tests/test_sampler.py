"""ResumableSampler: determinism, DP split, and resume from global samples consumed on any DP size."""

import pytest

from lit_lm.sampler import ResumableSampler


def global_stream(n: int, replicas: int, batch: int, seed: int = 0, epoch: int = 0, start: int = 0) -> list[int]:
    """Interleave the ranks' batches back into the global order they consume together."""
    samplers = [ResumableSampler(n, replicas, r, shuffle=True, seed=seed) for r in range(replicas)]
    for s in samplers:
        s.resume(epoch, start)
    per_rank = [list(s) for s in samplers]
    out = []
    for step in range(len(per_rank[0]) // batch):
        for k in range(batch):
            for r in range(replicas):
                out.append(per_rank[r][step * batch + k])
    return out


def test_deterministic_from_seed_and_epoch():
    a = list(ResumableSampler(50, seed=3))
    assert a == list(ResumableSampler(50, seed=3))
    assert sorted(a) == list(range(50)) and a != list(range(50))
    s = ResumableSampler(50, seed=3)
    s.set_epoch(1)
    assert list(s) != a
    assert list(ResumableSampler(50, seed=4)) != a


def test_ranks_partition_the_epoch_evenly():
    parts = [list(ResumableSampler(103, 4, r, seed=1)) for r in range(4)]
    assert {len(p) for p in parts} == {25}  # 103 trimmed to 100: every rank runs the same number of batches
    flat = [i for p in parts for i in p]
    assert len(set(flat)) == 100


def test_global_batches_do_not_depend_on_dp_size():
    """The samples of global step s are the same set whatever the number of ranks (global batch fixed)."""
    one = global_stream(96, 1, 8)
    two = global_stream(96, 2, 4)
    four = global_stream(96, 4, 2)
    for s in range(12):
        window = slice(8 * s, 8 * (s + 1))
        assert sorted(one[window]) == sorted(two[window]) == sorted(four[window])


@pytest.mark.parametrize("replicas_after", [1, 2, 3])
def test_resume_continues_the_stream_on_any_dp_size(replicas_after):
    full = list(ResumableSampler(60, 1, 0, seed=9))
    consumed = 24  # e.g. 3 steps of 4 samples on 2 ranks
    resumed = [list(ResumableSampler(60, replicas_after, r, seed=9)) for r in range(replicas_after)]
    samplers = [ResumableSampler(60, replicas_after, r, seed=9) for r in range(replicas_after)]
    for s in samplers:
        s.resume(0, consumed)
    resumed = [list(s) for s in samplers]
    merged = sorted(i for part in resumed for i in part)
    expected = full[consumed: consumed + len(resumed[0]) * replicas_after]
    assert merged == sorted(expected)
    assert not set(merged) & set(full[:consumed])  # nothing replayed


def test_resume_offset_applies_to_its_epoch_only():
    s = ResumableSampler(20, seed=0)
    s.resume(2, 10)
    assert len(s) == 10
    s.set_epoch(2)
    assert len(s) == 10
    s.set_epoch(3)
    assert len(s) == 20
