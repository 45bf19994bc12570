"""The most even cut of a sequence into contiguous runs: how pipeline stages are drawn.

Shared by the planner (which stage is fullest) and ``prepare_model(..., pp=)`` (where to cut),
so that the plan describes the stages the run builds. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence


def balanced_bounds(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: ``parts`` contiguous runs of ``sizes`` with the smallest maximum.

    Ties go to the earliest cut; every run holds at least one item.
    """
    count = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: the smallest largest part when cutting the first i items into k parts.
    inf = float("inf")
    best = [[inf] * (count + 1) for _ in range(parts + 1)]
    cut = [[0] * (count + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, count + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    bounds: list[tuple[int, int]] = []
    stop = count
    for k in range(parts, 0, -1):
        start = cut[k][stop]
        bounds.append((start, stop))
        stop = start
    return bounds[::-1]
