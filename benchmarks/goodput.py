"""Goodput under failures: how much of the run's time trains the model when nodes come and go.

Every side trains the same rows once (an epoch of a Parquet dataset of ids; a small transformer
language model, :mod:`goodput_train`) on a 4-node ``LocalCluster`` of one rank a node, while
the same seeded schedule of losses plays against it (:mod:`goodput_plan`: a node SIGKILLed every
``--mean-between`` seconds on average, a share of them notices first, each node back after
``--back-after`` seconds). For each side:

* wall: from the ``launch`` call to its return (or the rival's start to its end);
* goodput: the committed steps x the fault-free step time (the median time between two
  committed steps at 4 ranks, in the same run) / wall; a step at fewer ranks counts as a step
  (the nodes out are not paid for), a step dropped or trained again after a restart does not;
* at 4: the same at full size: the rows trained / (4 x batch) steps x the fault-free step /
  wall, which also counts the capacity out while a node is away as lost;
* exactly once: rows trained twice or never (a side with either fails its check); the rows the
  reader repeats to pad a rest that does not divide among the ranks are shown apart.
* rows/s: the distinct rows trained / wall, comparable across sides (the same rows, model and
  batch), where goodput measures each side against its own fault-free step;
* where the wall time went (:func:`goodput_plan.spent`): start-up, gaps at a loss, long gaps
  while a returning node starts, other stalls, slow steps, the end.

Sides today: sparktrain in place with DDP's layout, in place with HSDP (2 replica groups of 2
shards, ``fully_shard`` in each), sparktrain's restart path (DDP, asynchronous checkpoints
every ``--every`` steps, ``grow_back``), and torchrun's elastic agent (four agents, DDP, DCP
``async_save`` every ``--every`` steps: :mod:`goodput_torchrun`), and torchft (four replica
groups of one process, its lighthouse, DDP: :mod:`goodput_torchft`, in a venv of its own made on
first use), and Ray Train v2 (its elastic worker group on a 4-node Ray cluster on this
machine, checkpoints reported to it: :mod:`goodput_raytrain`), and sparktrain in place with
DDP's layout on that Ray cluster (``inplace-ddp-ray``: :mod:`goodput_ray`).

    python benchmarks/goodput.py                      # 10 minutes of losses a side
    python benchmarks/goodput.py --minutes 3 --mean-between 30 --back-after 15

``--child`` is internal: the script runs each side in a process of its own with it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt, kill_tree, log, print_machine, report_leftovers
from goodput_plan import (
    STALL_STEPS,
    choose,
    full_size,
    goodput,
    node_starts,
    read_in_place,
    read_restarts,
    schedule,
    spent,
)

SIDES = {
    "inplace-ddp": "sparktrain in place, DDP",
    "inplace-hsdp": "sparktrain in place, HSDP 2x2",
    "inplace-zero": "sparktrain in place, ZeRO-1",
    "inplace-ddp-ray": "sparktrain in place, DDP, Ray",
    "restart": "sparktrain restart, ckpts",
    "torchrun": "torchrun elastic, DCP ckpts",
    "torchft": "torchft, 4 replica groups",
    "raytrain": "Ray Train v2 elastic, ckpts",
}
WORLD, BATCH = 4, 4
#: A notice's lead time: the node's machine goes this long after ``preempt``.
NOTICE_SECONDS = 2.0


def _rows(minutes: float, step_seconds: float) -> int:
    """Rows for an epoch that lasts about ``minutes`` with no loss (a step's compute ~0.05 s).

    A multiple of 12 full batches, so that every world size from 1 to 4 divides the epoch. What
    is left of it after a resize need not divide by the new size: the reader pads that rest with
    up to ``world - 1`` repeated rows, which the table shows apart (``+N padded``).
    """
    return max(1, int(minutes * 60 / (step_seconds + 0.05)) // 12) * 12 * WORLD * BATCH


def write_rows(folder: Path, rows: int) -> str:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    pq.write_table(pa.table({"id": np.arange(rows, dtype=np.int64)}), folder / "part-0.parquet",
                   row_group_size=256)  # fmt: skip
    return str(folder)


def _play(cluster: Any, faults: list, in_place: bool, stop: threading.Event, struck: list) -> None:
    """Apply ``faults`` to ``cluster`` from now on, until ``stop``."""
    import sparktrain

    start = time.monotonic()
    for fault in faults:
        if stop.wait(max(0.0, start + fault.at - time.monotonic())):
            return
        node = choose(fault.pick, cluster.nodes_up)
        if node is None:
            struck.append({"at": fault.at, "kind": "none up"})
            continue
        kind, lead = fault.kind, 0.0
        if kind == "notice" and in_place:
            try:
                sparktrain.preempt(f"node{node}")
                lead = NOTICE_SECONDS
            except sparktrain.ConfigError:  # its node is starting or gone: the machine goes
                kind = "kill"
        else:
            kind = "kill"
        threading.Timer(lead, cluster.kill_node, (node,)).start()
        threading.Timer(lead + fault.back_after, cluster.add_node).start()
        struck.append({"at": round(time.monotonic() - start, 2), "kind": kind, "node": node})


def child(side: str, work: Path, args: argparse.Namespace) -> None:
    """Run one side on a fresh 4-node LocalCluster; write ``work/result.json``."""
    import goodput_train

    import sparktrain
    from sparktrain import LocalCluster, launch

    seconds = args.minutes * 60 * 3  # losses keep coming while the run lasts
    faults = (
        schedule(args.seed, seconds, args.mean_between, args.back_after, args.notice_share)
        if args.mean_between > 0
        else []  # the fault-free control (--control)
    )
    began = time.time()  # the launch, or the rival's start
    if side == "torchrun":
        import goodput_torchrun

        worker = [str(work / "data"), str(work / "ckpt"), str(work / "logs"),
                  str(args.step_seconds), str(BATCH), str(args.every)]  # fmt: skip
        payload = goodput_torchrun.run(work, WORLD, worker, faults, args.limit)
        (work / "result.json").write_text(json.dumps({"began": began, **payload}))
        return
    if side == "raytrain":
        import goodput_raytrain

        worker = [str(work / "data"), str(work / "logs"), str(args.step_seconds), str(BATCH),
                  str(args.every)]  # fmt: skip
        payload = goodput_raytrain.run(work, WORLD, worker, faults, args.limit)
        (work / "result.json").write_text(json.dumps({"began": began, **payload}))
        return
    if side == "torchft":
        import goodput_torchft

        worker = [str(work / "data"), str(work / "logs"), str(args.step_seconds), str(BATCH)]
        payload = goodput_torchft.run(work, WORLD, worker, faults, args.limit)
        (work / "result.json").write_text(json.dumps({"began": began, **payload}))
        return
    in_place = side.startswith("inplace")
    struck: list[dict[str, Any]] = []
    stop = threading.Event()
    data, logs = str(work / "data"), str(work / "logs")
    if in_place:
        replicas = 2 if side == "inplace-hsdp" else 0
        function: Any = goodput_train.train_in_place
        zero = 1 if side == "inplace-zero" else 0
        # what its restart path resumes from where a loss leaves no live copy (not DDP's)
        ckpt = str(work / "ckpt") if side in ("inplace-hsdp", "inplace-zero") else ""
        fargs: tuple[Any, ...] = (data, logs, replicas, args.step_seconds, BATCH, zero, ckpt,
                                  args.every)  # fmt: skip
    else:
        function = goodput_train.train_restart
        fargs = (data, str(work / "ckpt"), logs, args.step_seconds, BATCH, args.every)
    if side.endswith("-ray"):
        import goodput_ray

        payload = goodput_ray.run(work, WORLD, function, fargs, faults, args.limit)
        (work / "result.json").write_text(json.dumps({"began": began, **payload}))
        return
    cluster = LocalCluster(nodes=WORLD)
    player = threading.Thread(target=_play, args=(cluster, faults, in_place, stop, struck))
    began, started = time.time(), time.monotonic()
    player.start()
    try:
        result = launch(
            function, fargs, num_processes=WORLD, backend=cluster,
            min_processes=1, grow_back=True, in_place=in_place,
            max_rescales=100_000, progress=False, log_ranks=[], timeout=args.limit,
        )  # fmt: skip
    finally:
        stop.set()
        player.join()
    wall = time.monotonic() - started
    rescales = [(r.cause, r.old_world_size, r.new_world_size, r.in_place, r.at)
                for r in result.rescales]  # fmt: skip
    payload = {"wall": wall, "struck": struck, "rescales": rescales, "attempts": result.attempts,
               "began": began}  # fmt: skip
    (work / "result.json").write_text(json.dumps(payload))
    time.sleep(1.0)  # the last timers' nodes
    sparktrain.shutdown_warm()


def run_side(side: str, work: Path, args: argparse.Namespace, rows: int) -> dict[str, Any]:
    """One side in a child process; what its logs and result say."""
    work.mkdir(parents=True)
    (work / "logs").mkdir()
    write_rows(work / "data", rows)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", side, str(work)]
    command += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                if k not in ("child", "keep", "control")]  # fmt: skip
    with (work / "child.log").open("w") as out:
        # a session of its own, so that its tree can be killed without this process
        child = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | str = child.wait(timeout=args.limit + 60)
        except subprocess.TimeoutExpired:  # the run's own timeout did not end it: a hang
            code = f"still running {args.limit + 60:.0f} s after its start (killed)"
        finally:  # a hang, or Ctrl-C (the child's session does not get it)
            if child.poll() is None:
                kill_tree(child.pid)
                child.wait()
    found: dict[str, Any] = {"side": SIDES[side], "problems": []}
    if code != 0:
        text = (work / "child.log").read_text()
        if args.keep:
            log(f"{side}: its output is in {work / 'child.log'}")
        tail = "\n".join(text.strip().splitlines()[-12:])
        found["problems"].append(f"exit {code}:\n{tail}")
        return found
    result = json.loads((work / "result.json").read_text())
    in_place = side.startswith("inplace") or side == "torchft"  # steps never go back
    trained = (read_in_place if in_place else read_restarts)(work / "logs")
    step = trained.step_seconds(WORLD)
    found.update(result)
    found.update(
        rows=len(set(trained.rows)), duplicated=trained.duplicated(), padded=trained.padded(),
        missing=trained.missing(rows), step=step, dropped=trained.dropped,
        steps=trained.steps, goodput=goodput(trained, result["wall"], step),
        full_size=full_size(trained, WORLD, BATCH, result["wall"], step),
        checkpoint_files=len(list(work.glob("ckpt/**/*"))),
    )  # fmt: skip
    began = result.get("began", 0.0)
    losses, starts = node_starts(
        began, result["struck"], result["rescales"], args.back_after, NOTICE_SECONDS
    )
    found["spent"] = spent(trained, began, result["wall"], step, losses, starts)
    if found["duplicated"] or found["missing"]:
        found["problems"].append(f"{found['duplicated']} rows twice, {found['missing']} never")
    return found


def borrow_step(found: list[dict[str, Any]]) -> None:
    """A DDP side that never trained at 4 ranks has no fault-free step of its own: it takes the
    restart side's (the same model, DDP and batch), and says so."""
    lender = next((f for f in found if f["side"] == SIDES["restart"] and f.get("step")), None)
    for f in found:
        if "rows" in f and f.get("step") is None and lender and "HSDP" not in f["side"]:
            f["step"], f["step_from"] = lender["step"], lender["side"]
            f["goodput"] = f["steps"] * lender["step"] / f["wall"]
            f["full_size"] = f["rows"] / (WORLD * BATCH) * lender["step"] / f["wall"]


def print_table(found: list[dict[str, Any]], args: argparse.Namespace, rows: int) -> None:
    print(f"\nGoodput: {rows} rows once, 4 nodes of 1 rank, a loss every {args.mean_between:.0f} s"
          f" on average (seed {args.seed}, {args.notice_share:.0%} notices), back after "
          f"{args.back_after:.0f} s, {args.step_seconds} s sleep a step")  # fmt: skip
    print(f"{'side':28} {'wall s':>8} {'step s':>7} {'goodput':>8} {'at 4':>6} {'rows/s':>7}"
          f" {'losses':>7} {'rescales':>9} {'ckpt files':>10}  exactly once")  # fmt: skip
    for f in found:
        if "wall" not in f:
            print(f"{f['side']:28} failed: {'; '.join(f['problems'])}")
            continue
        losses = sum(1 for s in f["struck"] if s["kind"] != "none up")
        once = "; ".join(f["problems"]) or "yes"
        if f.get("padded"):
            once += f" (+{f['padded']} padded)"
        print(f"{f['side']:28} {f['wall']:8.1f} {fmt(f['step']):>7} {fmt(f['goodput']):>8} "
              f"{fmt(f['full_size']):>6} {f['rows'] / f['wall']:7.1f} {losses:>7} "
              f"{len(f['rescales']):>9} "
              f"{f['checkpoint_files']:>10}  {once}")  # fmt: skip
        if f.get("step_from"):
            print(f"{'':28} (never at 4 ranks: the fault-free step is {f['step_from']}'s)")
        if f.get("relaunches"):
            print(f"{'':28} (the job failed and was launched again {f['relaunches']} time(s))")
    print_spent(found)
    rivals = [f.get("goodput") or 0 for f in found if "in place" not in f["side"]]
    best_rival = max(rivals, default=0)
    pace = max((f["rows"] / f["wall"] for f in found
                if "in place" not in f["side"] and f.get("wall")), default=0)  # fmt: skip
    print("Goals")
    for f in found:
        if "in place" not in f["side"] or not f.get("goodput"):
            continue
        good, losses, dropped = f["goodput"], 0, f.get("dropped", 0)
        losses = sum(1 for s in f["struck"] if s["kind"] != "none up")
        print(f"  {f['side']}: goodput {good:.3f} (goal >= 0.95: {_met(good >= 0.95)}); at 4 "
              f"ranks {fmt(f['full_size'])}")  # fmt: skip
        _against_control(f)
        if best_rival:
            times = good / best_rival
            print(f"    {times:.2f}x the best other side's (goal >= 1.2x: {_met(times >= 1.2)})")
        if pace:  # the rows each side trained (once) a second of its wall: not a goal
            print(f"    rows trained a second {f['rows'] / f['wall']:.1f}, "
                  f"{f['rows'] / f['wall'] / pace:.2f}x the most of the other sides")  # fmt: skip
        print(f"    steps dropped {dropped} for {losses} loss(es) (goal: at most one a loss: "
              f"{_met(dropped <= losses)}); checkpoint files {f['checkpoint_files']} (goal: none, "
              "joiners heal from a live replica)")  # fmt: skip


def print_spent(found: list[dict[str, Any]]) -> None:
    """Where each side's wall time went (:func:`goodput_plan.spent`)."""
    print(f"Where the wall time went, s (start: launch to the first step that counts; at loss: "
          f"gaps holding a loss; starting: other gaps over {STALL_STEPS} steps while a returning "
          "node starts; stalls: the rest of those; slow: the other steps' excess; end: the last "
          "step to the return)")  # fmt: skip
    print(f"{'side':28} {'trained':>8} {'start':>7} {'at loss':>8} {'starting':>9} {'stalls':>7} "
          f"{'slow':>7} {'end':>6}")  # fmt: skip
    for f in found:
        if not f.get("spent"):
            continue
        used, parts = f["steps"] * f["step"], f["spent"]
        print(f"{f['side']:28} {used:8.1f} {parts['start']:7.1f} {parts['at_loss']:8.1f} "
              f"{parts['starting']:9.1f} {parts['stalls']:7.1f} {parts['slow']:7.1f} "
              f"{parts['end']:6.1f}")  # fmt: skip


def _against_control(f: dict[str, Any]) -> None:
    """With ``--control``: the side's goodput with its fault-free run's mean step (its wall time
    over its steps, start-up and the machine's jitter in it) as the fault-free step time."""
    control = f.get("control")
    if not control or not control.get("steps") or "wall" not in control:
        return
    against = f["steps"] * control["wall"] / control["steps"] / f["wall"]
    print(f"    against its fault-free run ({control['wall']:.1f} s, {control['steps']} steps, "
          f"its own goodput {fmt(control.get('goodput'))}): {against:.3f} (goal >= 0.95: "
          f"{_met(against >= 0.95)})")  # fmt: skip


def _met(yes: bool) -> str:
    return "met" if yes else "NOT met"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--mean-between", type=float, default=60.0)
    parser.add_argument("--back-after", type=float, default=20.0)
    parser.add_argument("--notice-share", type=float, default=0.25)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--every", type=int, default=50, help="restart path: steps a checkpoint")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--limit", type=float, default=3600.0)
    parser.add_argument("--sides", default=",".join(SIDES), help=f"of {', '.join(SIDES)}")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders")
    parser.add_argument(
        "--control", action="store_true",
        help="also run each side without faults: goodput against its fault-free wall time",
    )  # fmt: skip
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "WORK"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args.child[0], Path(args.child[1]), args)
        return 0
    print_machine("torch")
    rows = _rows(args.minutes, args.step_seconds)
    found = []
    sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        raise SystemExit(f"--sides: {unknown} unknown; pick from {', '.join(SIDES)}")
    tmp = tempfile.mkdtemp(prefix="goodput-")
    try:
        for index, side in enumerate(sides):
            log(f"{side}: {rows} rows")
            found.append(run_side(side, Path(tmp, f"side{index}"), args, rows))
            if args.control:
                log(f"{side}: {rows} rows, no faults (the control)")
                quiet = argparse.Namespace(**{**vars(args), "mean_between": 0.0})
                found[-1]["control"] = run_side(side, Path(tmp, f"control{index}"), quiet, rows)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    borrow_step(found)
    print_table(found, args, rows)
    report_leftovers()
    return 0 if all(not f["problems"] for f in found) else 1


if __name__ == "__main__":
    sys.exit(main())
