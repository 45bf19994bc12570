"""Atomic checkpoints that cost the loop one copy, written in the background.

``save(state, directory, step)`` copies the state's tensors into host buffers kept from save to
save and returns; a background writer writes each rank's part, and rank 0 publishes the
checkpoint (its ``COMPLETE`` manifest last, then one ``rename`` of the temporary folder) only
once every rank's part is on disk. A crash at any moment leaves either the previous checkpoints
only, or the new one whole; ``load_latest`` sees published checkpoints only. A second ``save``
while one is still being written waits for it (or is skipped with ``if_busy="skip"``): one
checkpoint in flight at most. ``wait()`` blocks until the latest is published; a rank
launched by sparktrain waits before its function's value is reported, and before the default
process group is destroyed. ``blocking=True`` returns only once the checkpoint is published.

Outside a sparktrain launch (torchrun, say), call ``wait()`` before ``destroy_process_group()``:
the writer's own gloo groups go with the default one.

A replicated state (DDP) is written by every rank, each its share of the large tensors;
``sharded=True`` writes each rank's shards with ``torch.distributed.checkpoint`` (FSDP, ZeRO).
The last ``keep`` checkpoints are kept.

In an elastic run (``min_processes``), a checkpoint is where the run may change size: each
checkpoint records the world size it was saved at, ``load_latest`` calls ``on_rescale(old,
new)`` when that differs from the current one (to scale the learning rate), and ``save`` raises
:class:`~sparktrain.ground.errors.GrowBack` in every rank, once the checkpoint is published,
when the driver has asked the run to grow back.
"""

from __future__ import annotations

from sparktrain.rank.checkpoints.loading import Checkpoint, latest_step, load_latest
from sparktrain.rank.checkpoints.saving import save, wait

__all__ = ["Checkpoint", "latest_step", "load_latest", "save", "wait"]
