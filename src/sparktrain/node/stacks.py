"""Where a hung rank waits: read ``faulthandler``'s dump of its Python stacks.

The dump lists each thread, most recent call first. We take the thread that received the signal
("Current thread", the main one in practice), its innermost frame (``all_reduce``, ``barrier``,
``wait``...) and the innermost frame that belongs to the user: not torch, not the standard
library, not sparktrain.
"""

from __future__ import annotations

import re
import sysconfig
import time
from collections.abc import Mapping
from pathlib import Path

from sparktrain.errors import StackSite

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
_LIBRARY_PARTS = ("/torch/", "/sparktrain/", "/site-packages/", "/dist-packages/")


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(str(Path(paths[k])) for k in ("stdlib", "platstdlib") if k in paths)


def _is_library(file: str, roots: tuple[str, ...]) -> bool:
    return file.startswith("<") or any(p in file for p in _LIBRARY_PARTS) or file.startswith(roots)


def _threads(text: str) -> list[tuple[bool, list[str]]]:
    threads: list[tuple[bool, list[str]]] = []
    for line in text.splitlines():
        header = _THREAD.match(line)
        if header:
            threads.append((header.group(1) == "Current thread", []))
        elif threads and _FRAME.match(line):
            threads[-1][1].append(line.strip())
    return threads


def parse(text: str, rank: int) -> StackSite | None:
    """The site where ``rank`` waits, from its faulthandler dump, or ``None`` if unreadable."""
    threads = [t for t in _threads(text) if t[1]]
    if not threads:
        return None
    current = [frames for is_current, frames in threads if is_current]
    frames = current[0] if current else threads[0][1]
    inner = _FRAME.match(frames[0])
    assert inner is not None
    roots = _library_roots()
    user = next(
        (m for m in map(_FRAME.match, frames) if m and not _is_library(m.group("file"), roots)),
        inner,
    )
    return StackSite(
        rank=rank,
        function=inner.group("func").strip(),
        user_file=user.group("file"),
        user_line=int(user.group("line")),
        user_function=user.group("func").strip(),
        stack="\n".join(frames),
    )


def collect(paths: Mapping[int, Path], within: float) -> dict[int, StackSite]:
    """Read each rank's stack dump from ``paths`` as it appears, for up to ``within`` seconds."""
    deadline = time.monotonic() + within
    sites: dict[int, StackSite] = {}
    while len(sites) < len(paths) and time.monotonic() < deadline:
        time.sleep(0.1)
        for rank, path in paths.items():
            if rank not in sites and path.exists():
                site = parse(path.read_text(errors="replace"), rank)
                if site is not None:
                    sites[rank] = site
    return sites
