"""Text tables for the planner's reports: aligned columns, plurals, a fit in a word."""

from __future__ import annotations

from collections.abc import Sequence


def plural(count: int, word: str) -> str:
    """``count`` and ``word``, plural unless the count is one."""
    return f"{count} {word}" + ("s" if count != 1 else "")


def verdict(fits: bool, roomy: bool, cpu_checked: bool) -> str:
    """Whether it fits, in a word: yes, tight or no (``?`` when the CPU side was not checked)."""
    word = "yes" if roomy else "tight" if fits else "no"
    return word if cpu_checked or not fits else f"{word} ?"


def table(rows: Sequence[Sequence[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    """``rows`` (the first is the header) as aligned lines; the columns ``left`` to the left."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        cells = [
            cell.ljust(w) if i in left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return out
