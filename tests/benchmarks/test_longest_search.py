"""The longest-sequence search of benchmarks/sequence_parallel.py (`areas.parallel.longest_search.longest_within`) on
peak-memory curves whose answer is known: it returns the exact longest length, never probes above the cap (the quick
mode once asked the allocator for 10^16 bytes), and settles in a bounded number of runs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from areas.parallel.longest_search import longest_within  # noqa: E402

MiB = 2**20


def brute_force(peak_of, budget, unit, cap):
    fitting = [n for n in range(unit, cap + 1, unit) if peak_of(n) <= budget]
    return max(fitting, default=0)


def flat_then_affine(n):
    """The shape measured on the tiny Llama: gradients (6.9 MB) dominate up to ~200 tokens, then 50 KB a token."""
    return max(6_886_408 + 1024 * n, 50_500 * n)


CURVES = {
    "affine": lambda n: 3 * MiB + 4096 * n,
    "flat then affine": flat_then_affine,
    "steps": lambda n: 2 * MiB + 1 * MiB * (n // 700),  # not affine anywhere: jumps every 700 tokens
    "superlinear": lambda n: 1 * MiB + n * n // 2,  # attention scores materialised
}


@pytest.mark.parametrize("curve", CURVES.values(), ids=CURVES.keys())
@pytest.mark.parametrize("budget_mib", [8, 32])
@pytest.mark.parametrize("start", [64, 512, 4096])
def test_finds_the_exact_longest_length_and_never_probes_above_the_cap(curve, budget_mib, start):
    budget, unit, cap = budget_mib * MiB, 64, 64 * 1024
    got = longest_within(curve, budget, unit=unit, start=start, cap=cap)
    assert got.length == brute_force(curve, budget, unit, cap)
    assert not got.capped
    assert all(n % unit == 0 and unit <= n <= cap for n in got.peaks)
    assert got.runs <= 2 * math.log2(cap / unit) + 6  # doubling at least, then at least halving every 3 probes


def test_an_affine_peak_is_settled_by_its_prediction_and_the_next_unit():
    def affine(n):
        return 3 * MiB + 4096 * n

    got = longest_within(affine, 32 * MiB, unit=64, start=512, cap=1 << 20)
    assert got.length == 7424  # (32 - 3) MiB / 4096 B = 7424 tokens
    # 512 fits, 2048 (at most x4) fits, 7424 (the line through them) fits, 7488 (the next unit) does not
    assert list(got.peaks) == [512, 2048, 7424, 7488]


def test_a_peak_that_does_not_grow_stops_at_the_cap_and_says_so():
    """The quick mode's failure: the peak of two short probes was the gradients alone, so the slope was ~0 and the
    old prediction was ~10^15 tokens. Now the growth is bounded and the cap ends it."""
    asked = []

    def flat(n):
        asked.append(n)
        return 7 * MiB

    got = longest_within(flat, 8 * MiB, unit=128, start=128, cap=8 * MiB // (256 * 4) * 2)
    assert got.capped and got.length == 16384
    assert max(asked) == 16384 and asked == sorted(asked)
    assert all(b <= 4 * a for a, b in zip(asked, asked[1:]))


def test_nothing_fits_returns_zero_and_a_short_fit_found_below_a_failing_start_is_kept():
    assert longest_within(lambda n: 9 * MiB, 8 * MiB, unit=64, start=512, cap=8192).length == 0
    # the old search returned 0 here: its prediction (1472) failed and it never went back to the probe that fit
    got = longest_within(flat_then_affine, 8 * MiB, unit=64, start=64, cap=8192)
    assert got.length == brute_force(flat_then_affine, 8 * MiB, 64, 8192) == 128


def test_a_cap_below_one_unit_probes_nothing_and_bad_arguments_say_what_to_change():
    assert longest_within(lambda n: 0, MiB, unit=64, start=64, cap=63).runs == 0
    with pytest.raises(ValueError, match="unit must be positive"):
        longest_within(lambda n: 0, MiB, unit=0, start=64, cap=640)
