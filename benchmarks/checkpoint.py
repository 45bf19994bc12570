"""Checkpoint benchmark: what a checkpoint costs the loop, sparktrain against torch's own ways.

Two ranks (``sparktrain.launch``, gloo) hold the same state: an MLP of ``--layers`` layers of
``--width`` x ``--width`` (8 x 4096 x 4096 by default: 134 M parameters, 0.54 GB) with its Adam
state (two more copies), about 1.6 GB a rank, as ``get_state_dict(model, optimizer)`` gives it.
Each way saves the same state once alone (for its memory), then ``--repeat`` times into a
folder of its own under ``--dir``, in rounds (each round every way once, the order turned by
one each round, so that the disk's writeback of earlier saves falls on every way alike; each way
keeps its newest checkpoint):

* bare copy: the state's tensors copied into host buffers allocated beforehand (the floor:
  nothing can stage a state in less);
* torch.save from rank 0: rank 0 writes the whole state with ``torch.save`` and flushes it, the
  other rank waits at a barrier (sparktrain's ``save`` before it was asynchronous);
* DCP save: ``torch.distributed.checkpoint.save`` (every rank writes a share);
* DCP async_save: ``torch.distributed.checkpoint.async_save`` with its defaults, then the
  future's ``result()``;
* sparktrain: ``sparktrain.checkpoint.save`` (asynchronous), then ``checkpoint.wait()``.

For each, over the two ranks (the slower rank's figure, as the loop waits for it):

* stall: from the call to its return, the time the training loop is blocked;
* durable: from the call until the checkpoint is on disk (fsynced) and, for sparktrain,
  published (``checkpoint.wait()`` returned); sparktrain then copies it into the node's memory
  in the background (the next save waits for that copy): the time from the call until that
  copy is done is printed apart, and each way is timed only once it is done;
* peak extra memory: the rank's peak resident memory during the way's first save (``VmHWM``,
  reset before; each way's first save alone, a second after the previous way's, before the
  timed rounds) minus its resident memory just before it; for sparktrain that first save
  allocates the host buffers it keeps; for the bare copy, its buffers. sparktrain also keeps
  the newest checkpoint's files in the node's memory (``/dev/shm``, for restarts): printed
  apart.

The medians of the timed rounds are printed; sparktrain's first save (which allocates its
buffers) is printed on its own line. Then the goals: sparktrain's stall against the bare copy
(at most 1.2x) and against DCP ``async_save`` (at most 0.5x), its time to durable against DCP
``save`` (at most 1x).

    python benchmarks/checkpoint.py --repeat 5        # about 3 minutes on 2 cores
    python benchmarks/checkpoint.py --layers 2 --repeat 2   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import log, print_machine, report_leftovers

WAYS = ("bare copy", "torch.save rank 0", "DCP save", "DCP async_save", "sparktrain")


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _tensors(state: Any) -> list[Any]:
    import torch

    if isinstance(state, dict):
        return [t for value in state.values() for t in _tensors(value)]
    return [state] if isinstance(state, torch.Tensor) else []


def state_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that size the state and place its checkpoints (shared by the restart one)."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--dir", default=None, help="where checkpoints go (a temporary folder)")


def _state(layers: int, width: int) -> tuple[Any, Any, Any]:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return model, optimizer, {"model": model_sd, "optim": optim_sd}


def rank_body(folder: str, layers: int, width: int, repeat: int) -> dict[str, Any]:
    """One rank: every way, ``repeat`` times each; its timings and memory."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from sparktrain import checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    _model, _optimizer, state = _state(layers, width)
    tensors = _tensors(state)
    out: dict[str, Any] = {"bytes": sum(t.numel() * t.element_size() for t in tensors)}

    buffers = [torch.zeros_like(t) for t in tensors]  # allocated and touched beforehand

    def bare(_where: Path, _step: int) -> None:
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor)

    def rank0(where: Path, step: int) -> None:
        if rank == 0:
            where.mkdir(parents=True, exist_ok=True)
            path = where / f"state-{step}.pt"
            torch.save(state, path)
            _fsync_file(path)
        dist.barrier()

    ways: dict[str, tuple[Any, Any]] = {
        "bare copy": (bare, lambda _h: None),
        "torch.save rank 0": (rank0, lambda _h: None),
        "DCP save": (
            lambda where, step: dcp.save(state, checkpoint_id=str(where / f"step-{step}")),
            lambda _h: None,
        ),
        "DCP async_save": (
            lambda where, step: dcp.async_save(state, checkpoint_id=str(where / f"step-{step}")),
            lambda future: future.result(),
        ),
        "sparktrain": (
            lambda where, step: checkpoint.save(state, where, step, keep=1),
            lambda _h: checkpoint.wait(),
        ),
    }
    for name in ways:
        out[name] = {"stall": [], "durable": [], "peak": 0}
    out["sparktrain"]["kept"] = []

    def timed(name: str, step: int) -> tuple[float, float]:
        call, durable = ways[name]
        where = Path(folder) / name.replace(" ", "_").replace(".", "")
        dist.barrier()
        start = time.perf_counter()
        handle = call(where, step)
        stall = time.perf_counter() - start
        durable(handle)
        done = time.perf_counter() - start
        del handle
        if name == "sparktrain":  # its node memory copy ends before anything else is timed
            checkpoint.wait(in_memory=True)
            out[name]["kept"].append(time.perf_counter() - start)
        dist.barrier()
        if rank == 0 and name != "sparktrain":  # the others keep one checkpoint too
            shutil.rmtree(where / f"step-{step - 1}", ignore_errors=True)
            (where / f"state-{step - 1}.pt").unlink(missing_ok=True)
        return stall, done

    # Memory first: each way's first save alone, after what the one before freed is gone.
    for name in ways:
        gc.collect()
        time.sleep(1.0)
        _reset_peak()
        base = _rss("VmRSS:")
        out[name]["first"] = timed(name, 0)
        out[name]["peak"] = _rss("VmHWM:") - base
    out["bare copy"]["peak"] = out["bytes"]  # its buffers, allocated beforehand
    # Then the timings, in rounds, the order turned each round: the disk's writeback of the
    # previous save falls on every way alike.
    for step in range(1, repeat + 1):
        names = list(ways)
        names = names[step % len(names) :] + names[: step % len(names)]
        for name in names:
            stall, done = timed(name, step)
            out[name]["stall"].append(stall)
            out[name]["durable"].append(done)
    from sparktrain.rank.checkpoints import memory

    dist.barrier()
    out["kept"] = memory.kept_bytes()  # the node's memory copy (both ranks share one node)
    return out


def _table(values: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for name in WAYS:
        per_rank = [v[name] for v in values.values()]
        repeats = len(per_rank[0]["stall"])
        slowest = {
            key: [max(r[key][i] for r in per_rank) for i in range(repeats)]
            for key in ("stall", "durable")
        }
        rows[name] = {
            "stall": statistics.median(slowest["stall"]),
            "durable": statistics.median(slowest["durable"]),
            "first stall": max(r["first"][0] for r in per_rank),
            "first durable": max(r["first"][1] for r in per_rank),
            "peak": max(r["peak"] for r in per_rank) / 1e9,
            "durables": slowest["durable"],
            "kept": statistics.median(max(r["kept"][i] for r in per_rank) for i in range(repeats))
            if "kept" in per_rank[0]
            else None,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    state_arguments(parser)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import torch

    from sparktrain import launch

    print_machine("torch")
    folder = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    log(f"2 ranks, {args.layers} x {args.width}^2 MLP + Adam, {args.repeat} saves a way: {folder}")
    try:
        run = launch(
            rank_body,
            (folder, args.layers, args.width, args.repeat),
            num_processes=2,
            use_gpu=False,
            return_all=True,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    values = run.return_values
    state_gb = values[0]["bytes"] / 1e9
    print(f"State: {state_gb:.2f} GB a rank (parameters and Adam's two moments), 2 ranks, "
          f"torch {torch.__version__}, {args.repeat} saves a way")  # fmt: skip
    print("Each figure: the median of the saves, for the slower rank")
    rows = _table(values)
    print(f"{'way':<20} {'stall s':>9} {'durable s':>10} {'peak extra GB':>14}")
    for name, row in rows.items():
        durable = "-" if name == "bare copy" else f"{row['durable']:.3f}"
        print(f"{name:<20} {row['stall']:>9.3f} {durable:>10} {row['peak']:>14.2f}")
    ours = rows["sparktrain"]
    print(f"{'sparktrain, 1st save':<20} {ours['first stall']:>9.3f} {ours['first durable']:>10.3f}"
          "      (allocates its host buffers)")  # fmt: skip
    print(f"{'sparktrain, in memory':<20} {'':>9} {ours['kept']:>10.3f}"
          "      (then copied into the node's memory; the next save waits for it)")  # fmt: skip
    for name in ("DCP save", "DCP async_save", "sparktrain"):
        each = " ".join(f"{d:.3f}" for d in rows[name]["durables"])
        print(f"  durable, each save, {name}: {each}")
    print()
    print("Goals")
    for label, num, den, goal in (
        ("stall / bare copy", ours["stall"], rows["bare copy"]["stall"], 1.2),
        ("stall / DCP async_save's", ours["stall"], rows["DCP async_save"]["stall"], 0.5),
        ("durable / DCP save's", ours["durable"], rows["DCP save"]["durable"], 1.0),
    ):
        value = num / den
        verdict = "met" if value <= goal else "NOT met"
        print(f"  {label:<26} {value:6.2f}x  (goal <= {goal}x: {verdict})")
    print(f"  peak extra memory          {ours['peak']:.2f} GB  (one copy of a rank's share: "
          f"{state_gb / 2:.2f} GB; of its state: {state_gb:.2f} GB)")  # fmt: skip
    kept = values[0]["kept"] / 1e9
    print(
        f"  node memory (for restarts) {kept:.2f} GB  (the newest checkpoint's files, both "
        "ranks': in /dev/shm, not in a rank's resident memory)"
    )
    report_leftovers()


if __name__ == "__main__":
    main()
