"""A node's checkpoint memory: a folder in host memory that outlives the run's attempts.

The ranks of a node keep the newest checkpoint's parts there (and a copy of a neighbour node's),
so that a restart on the survivors loads from memory instead of storage
(:mod:`sparktrain.rank.checkpoints.memory`). The folder is on ``/dev/shm`` (memory, not disk)
where the machine has one, named after its owner (the process that outlives the attempts: the
caller for the local backend and a ``LocalCluster``), so a sweep removes it when that owner was
killed; the owner removes it when the run ends. Losing a node loses its memory: a
``LocalCluster`` removes the folder of a node it kills.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable

from sparktrain.rank import rundirs

#: Where memory folders go: the machine's shared memory, else the temporary folder.
SHM = "/dev/shm"


def root() -> str:
    """The folder memory folders are made in: ``/dev/shm`` where writable, else the temp folder."""
    if os.path.isdir(SHM) and os.access(SHM, os.W_OK | os.X_OK):
        return SHM
    return tempfile.gettempdir()


def make() -> str:
    """A new memory folder owned by this process (dead owners' folders are swept first)."""
    return rundirs.make("memory", root())


def remove(folder: str | None) -> None:
    """Remove a memory folder and what it holds (nothing if ``folder`` is empty or gone)."""
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


class Memories:
    """The memory folders a driver keeps for the nodes of its runs, by run and node.

    Runs of one backend may overlap (the trials of a search): each run has its own folders,
    made on first use and removed at its end (:meth:`end`) or with a lost node (:meth:`lose`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._folders: dict[tuple[str, int], str] = {}

    def of(self, run: str, node: int) -> str:
        """The folder of ``node`` in ``run`` (made on first use)."""
        with self._lock:
            folder = self._folders.get((run, node))
            if folder is None:
                folder = self._folders[run, node] = make()
            return folder

    def lose(self, node: int) -> None:
        """Remove ``node``'s folders, in every run: a lost machine's memory is lost with it."""
        self._drop(lambda run, where: where == node)

    def end(self, run: str) -> None:
        """Remove every folder of ``run``: it is over."""
        self._drop(lambda key, _node: key == run)

    def _drop(self, which: Callable[[str, int], bool]) -> None:
        with self._lock:
            gone = [key for key in self._folders if which(*key)]
            folders = [self._folders.pop(key) for key in gone]
        for folder in folders:
            remove(folder)
