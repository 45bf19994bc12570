"""``sparktrain.checkpoint``: atomic, asynchronous checkpoints that a restarted run resumes from.

The public name of :mod:`sparktrain.rank.checkpoint` (where the code lives, with the rest of
what runs inside a rank): ``from sparktrain import checkpoint`` and
``import sparktrain.checkpoint`` both give these functions.
"""

from sparktrain.rank.checkpoint import Checkpoint, latest_step, load_latest, save, wait

__all__ = ["Checkpoint", "latest_step", "load_latest", "save", "wait"]
