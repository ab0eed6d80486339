"""The longest length whose measured peak memory fits a budget, found with a bounded number of runs that never asks
for more than a hard cap.

Peak memory is not affine in the sequence length over the whole range: at short lengths the parameters' gradients
(allocated in every step, whatever the length) dominate and the peak barely moves, so a straight line through two
short probes can predict a length millions of times too long (the benchmark once asked the allocator for 10^16
bytes that way). Here a prediction only ever picks *where inside a bracket* to look next:

- grow: from `start`, each next length is at most `max_growth` times the last one that fit, and never above `cap`
  (the caller derives it from the budget: a length whose smallest tensor alone exceeds the budget cannot fit);
- shrink: once a length does not fit, the bracket [longest fitting, shortest failing] closes in rounds of three
  probes: the affine interpolation between the bracket's ends, its neighbour on the other side, then the midpoint
  (so each round at least halves the bracket, and an affine peak is settled by the first two probes).

Every length probed is a multiple of `unit`. `longest_within(peak_of, budget, unit=64, start=512, cap=8192)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Longest:
    """`length`: the longest multiple of `unit` that fit (0 when not even `unit` did); `capped`: the search reached
    `cap` without a failure (the true longest may be larger); `peaks`: every length probed -> its peak bytes."""

    length: int
    capped: bool
    peaks: dict[int, int] = field(default_factory=dict)

    @property
    def runs(self) -> int:
        return len(self.peaks)


def longest_within(
    peak_of: Callable[[int], int], budget: int, *, unit: int, start: int, cap: int, max_growth: int = 4
) -> Longest:
    """The longest multiple of `unit` in [unit, cap] whose `peak_of(length)` is at most `budget` (see the module)."""
    if unit <= 0 or max_growth < 2:
        raise ValueError(f"unit must be positive and max_growth at least 2, got unit={unit}, max_growth={max_growth}")
    peaks: dict[int, int] = {}
    cap = cap // unit * unit
    if cap < unit:
        return Longest(0, False, peaks)

    def fits(length: int) -> bool:
        if length not in peaks:
            peaks[length] = int(peak_of(length))
        return peaks[length] <= budget

    low, high = 0, None
    length = min(max(start // unit * unit, unit), cap)
    while high is None:  # grow
        if not fits(length):
            high = length
            break
        low = length
        if low == cap:
            return Longest(cap, True, peaks)
        guess = _predict(peaks, [n for n in sorted(peaks) if peaks[n] <= budget][-2:], budget)
        ceiling = min(max_growth * low, cap)
        length = _clamp(guess if guess is not None else ceiling, low + unit, ceiling, unit)
    probe, last = 0, None
    while high - low > unit:  # shrink: interpolate, its neighbour, bisect; repeat
        kind, probe = probe % 3, probe + 1
        if kind == 0 and low > 0:
            length = _predict(peaks, [low, high], budget)
        elif kind == 1 and last is not None:
            length = last + unit if fits(last) else last - unit
        else:
            length = (low + high) // 2
        length = _clamp(length if length is not None else (low + high) // 2, low + unit, high - unit, unit)
        last = length if kind == 0 else None
        if fits(length):
            low = length
        else:
            high = length
    return Longest(low, False, peaks)


def _predict(peaks: dict[int, int], lengths: list[int], budget: int) -> int | None:
    """Where the line through two probed (length, peak) points reaches the budget; None without a rising line."""
    if len(lengths) < 2:
        return None
    (a, b), (ma, mb) = lengths, (peaks[lengths[0]], peaks[lengths[1]])
    if mb <= ma:
        return None
    return int(a + (budget - ma) * (b - a) / (mb - ma))


def _clamp(length: int, lowest: int, highest: int, unit: int) -> int:
    return min(max(length // unit * unit, lowest), highest)
