"""Where a hung rank waits: read ``faulthandler``'s dump of its Python stacks.

The dump lists each thread, newest thread first and most recent call first. We take the thread
that runs the rank (the one whose frames pass through sparktrain's ``run_rank``; failing that the
one that received the signal, then the oldest), its innermost frame (``all_reduce``, ``barrier``,
``wait``...) and the innermost frame that belongs to the user: not torch, not the standard
library, not sparktrain. A dump is read only once it is whole: faulthandler writes it in many
small pieces, and half of one would lose the user's frame. The main thread is the oldest, so it
comes last, and its outermost frame is the module the process started with: the dump is whole
when its last line is that frame.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sysconfig
import time
from collections.abc import Mapping
from pathlib import Path

from sparktrain.ground.errors import StackSite

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
_OUTERMOST = ("<module>", "_run_module_as_main")
_INSTALLED_PARTS = ("/site-packages/", "/dist-packages/")
#: Packages whose frames are never the user's, wherever they live (an editable install, a
#: source checkout): a frame is theirs when the path after ``/<name>/`` is one of their files.
_PACKAGES = ("sparktrain", "torch")


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(str(Path(paths[k])) + "/" for k in ("stdlib", "platstdlib") if k in paths)


@functools.cache
def _package_dir(name: str) -> Path | None:
    """Where package ``name`` lives here, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(places[0]) if places else None


@functools.cache
def _in_package(file: str) -> bool:
    """Whether ``file`` is one of sparktrain's or torch's own files.

    The path after the last ``/sparktrain/`` must be a file of the package, so a user's project
    in a folder of that name (a clone called ``sparktrain``, ``~/work/torch/train.py``) is the
    user's.
    """
    for name in _PACKAGES:
        marker = f"/{name}/"
        if marker not in file:
            continue
        inside = file.rsplit(marker, 1)[1]
        found = _package_dir(name)
        if found is None or (found / inside).is_file():
            return True
    return False


def _is_library(file: str, roots: tuple[str, ...]) -> bool:
    return (
        file.startswith("<")
        or any(p in file for p in _INSTALLED_PARTS)
        or file.startswith(roots)
        or _in_package(file)
    )


def _threads(text: str) -> list[tuple[bool, list[str]]]:
    threads: list[tuple[bool, list[str]]] = []
    for line in text.splitlines():
        header = _THREAD.match(line)
        if header:
            threads.append((header.group(1) == "Current thread", []))
        elif threads and _FRAME.match(line):
            threads[-1][1].append(line.strip())
    return threads


def _rank_thread(threads: list[tuple[bool, list[str]]]) -> list[str]:
    """The frames of the thread that runs the rank's entry point."""
    for _, frames in threads:
        if any(line.endswith(" in run_rank") and "sparktrain" in line for line in frames):
            return frames
    current = [frames for is_current, frames in threads if is_current]
    return current[0] if current else threads[-1][1]


def parse(text: str, rank: int) -> StackSite | None:
    """The site where ``rank`` waits, from its faulthandler dump, or ``None`` if unreadable."""
    threads = [t for t in _threads(text) if t[1]]
    if not threads:
        return None
    frames = _rank_thread(threads)
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
            text = _read(path)
            if rank not in sites and _whole(text):
                site = parse(text, rank)
                if site is not None:
                    sites[rank] = site
    for rank, path in paths.items():  # out of time: part of a dump beats none
        if rank not in sites:
            site = parse(_read(path), rank)
            if site is not None:
                sites[rank] = site
    return sites


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _whole(text: str) -> bool:
    """Whether the dump ends with a process's outermost frame (see the module's docstring)."""
    lines = text.splitlines()
    last = _FRAME.match(lines[-1]) if lines and text.endswith("\n") else None
    return last is not None and last.group("func").strip() in _OUTERMOST
