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
