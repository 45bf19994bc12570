"""Restart benchmark: loading the newest checkpoint from the survivors' memory against storage.

A ``LocalCluster`` of 2 nodes (one rank each, gloo) holds the state of ``benchmarks/checkpoint.py``:
an MLP of ``--layers`` x ``--width``^2 with its Adam state (1.6 GB a rank by default). Both ranks
save it with ``sparktrain.checkpoint.save(..., replicas=1)`` into ``--dir`` and wait until it is
published and kept in memory; then node 1 is SIGKILLed (its memory goes with it). The elastic run
restarts on node 0 alone, which loads the checkpoint twice and times each load:

* from memory: ``checkpoint.load_latest`` with the node's memory (its own files and node 1's
  copy, mapped rather than read);
* from storage: the same call with the node's memory out of reach, after the checkpoint's files
  are dropped from the page cache (``posix_fadvise(DONTNEED)`` on each file, once fsynced), so
  the read comes from the disk, as on a restarted machine.

Each is timed from the call to its return (``load_latest``), until the loaded state is in the
live model and optimizer (``+ set_state_dict``), and until the first training step after it
has ended (``+ first step``: a forward, a backward and Adam's step; the optimizer's state
mapped from memory is copied on its first write there).

Each load's state is compared with the saved one (a digest of every tensor's bytes), and the
bytes each load read from memory and from storage are printed (``Checkpoint.read``). The goal:
the load from memory at least 5x faster than from storage, with no byte from storage.

    python benchmarks/checkpoint_restart.py                # about a minute on 2 cores
    python benchmarks/checkpoint_restart.py --layers 2     # a quick look
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import log, print_machine, report_leftovers
from checkpoint import _state, _tensors, state_arguments


def _digest(state: Any) -> str:
    import torch

    hasher = hashlib.blake2b(digest_size=16)
    for tensor in _tensors(state):
        hasher.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return hasher.hexdigest()


def _named(pair: tuple[Any, Any]) -> dict[str, Any]:
    """``get_state_dict``'s two halves, as the state was saved."""
    return {"model": pair[0], "optim": pair[1]}


def _drop_cache(folder: Path) -> None:
    """Evict the checkpoint's files from the page cache (they are fsynced, so clean)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def rank_body(folder: str, layers: int, width: int) -> dict[str, Any]:
    """Attempt 0: save and wait to be killed. Attempt 1 (node 0 alone): load twice, timed."""
    import torch.distributed as dist

    import sparktrain
    from sparktrain import checkpoint
    from sparktrain.contract import env

    dist.init_process_group("gloo")
    if sparktrain.restart_count() == 0:
        _model, _optimizer, state = _state(layers, width)
        started = time.perf_counter()
        checkpoint.save(state, folder, 1, replicas=1)
        checkpoint.wait(in_memory=True)
        sparktrain.report(step=1, digest=_digest(state), saved=time.perf_counter() - started)
        time.sleep(600)  # node 1 is killed; this attempt ends with it
        return {}
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer, _live = _state(layers, width)  # the restarted rank's own, before the load
    out: dict[str, Any] = {}
    for source in ("memory", "storage"):
        with torch.no_grad():  # whatever the live state holds now, the load must replace it
            for tensor in _tensors(_named(get_state_dict(model, optimizer))):
                tensor.zero_()
        if source == "storage":
            os.environ.pop(env.CHECKPOINT_MEMORY)  # the same call, as where no memory is kept
            _drop_cache(Path(folder))
        started = time.perf_counter()
        loaded = checkpoint.load_latest(folder)
        out[f"{source} load"] = time.perf_counter() - started
        assert loaded is not None
        set_state_dict(model, optimizer, model_state_dict=loaded.state["model"],
                       optim_state_dict=loaded.state["optim"])  # fmt: skip
        out[f"{source} applied"] = time.perf_counter() - started
        applied = _digest(_named(get_state_dict(model, optimizer)))  # not timed
        out[f"{source} digest"], out[f"{source} read"] = applied, dict(loaded.read)
        started = time.perf_counter()
        model(torch.ones(2, width)).sum().backward()
        optimizer.step()
        out[f"{source} stepped"] = out[f"{source} applied"] + time.perf_counter() - started
        optimizer.zero_grad()
        del loaded
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    state_arguments(parser)
    args = parser.parse_args()
    from sparktrain import LocalCluster, launch

    print_machine("torch")
    folder = tempfile.mkdtemp(prefix="ckpt-restart-", dir=args.dir)
    log(f"LocalCluster of 2 nodes, {args.layers} x {args.width}^2 MLP + Adam: {folder}")
    cluster = LocalCluster(nodes=2)
    saved: dict[str, Any] = {}

    def on_report(rank: int, record: dict[str, Any]) -> None:
        metrics = record.get("metrics") or {}
        if rank == 0 and "digest" in metrics and not saved:
            saved.update(metrics)
            killed = cluster.kill_node(1)
            log(f"saved in {metrics['saved']:.3f} s (published and in memory); killed node 1 "
                f"(pid {killed})")  # fmt: skip

    try:
        run = launch(
            rank_body,
            (folder, args.layers, args.width),
            num_processes=2,
            backend=cluster,
            min_processes=1,
            on_report=on_report,
            progress=False,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    value = run.value
    print(f"Restart after node 1 of 2 was SIGKILLed: rescales {[r.cause for r in run.rescales]}, "
          f"now {run.world_size} rank")  # fmt: skip
    print("Seconds from the call; GB read from each place; the state applied equal to the saved")
    print(f"{'load from':<10} {'load_latest':>12} {'+ set_state_dict':>17} {'+ first step':>13} "
          f"{'memory GB':>10} {'storage GB':>11} {'equal':>6}")  # fmt: skip
    for source in ("memory", "storage"):
        read = value[f"{source} read"]
        equal = value[f"{source} digest"] == saved["digest"]
        print(f"{source:<10} {value[f'{source} load']:>12.3f} {value[f'{source} applied']:>17.3f} "
              f"{value[f'{source} stepped']:>13.3f} {read.get('memory', 0) / 1e9:>10.2f} "
              f"{read.get('storage', 0) / 1e9:>11.2f} {equal!s:>6}")  # fmt: skip
    stepped = value["storage stepped"] / value["memory stepped"]
    print(f"Storage / memory, to the end of the first step: {stepped:.2f}x")
    ratio = value["storage applied"] / value["memory applied"]
    clean = value["memory read"].get("storage", 0) == 0
    verdict = "met" if ratio >= 5 and clean else "NOT met"
    print(f"Goal: memory at least 5x faster than storage (+ set_state_dict), nothing from "
          f"storage: {ratio:.2f}x, "
          f"{'no' if clean else 'some'} bytes from storage ({verdict})")  # fmt: skip
    report_leftovers()


if __name__ == "__main__":
    main()
