"""Chaos soak: random real 2-rank workloads under random faults, invariants checked after each.

For ``--minutes``, runs the schedule of ``--seed`` (``chaos_plan.py``: deterministic) one run
at a time. Each run is a real 2-rank launch of a few seconds, drawn from (``chaos_workloads.py``):

* ``ddp``: DDP on a tiny MLP, checkpointed every 3 steps, each step's gradients checked against
  the ranks' own ones all-reduced by hand; ``fsdp2``: ``fully_shard`` on the same MLP;
  ``deepspeed``: a ZeRO-2 engine on it (each compared with a one-process replay);
* ``stream``: DDP over ``sparktrain.data.from_parquet`` (one DataLoader worker), the data state
  checkpointed with the model; ``elastic``: the same on a ``LocalCluster`` of two nodes with
  ``min_processes=1``; ``spark``: the DDP run on a ``local-cluster[2,1,1024]`` session
  started once (``--no-spark`` leaves it out).

Each run gets ``timeout=30`` for each attempt it may start (the call's bound: 30 x its
restarts + 1, one more for an elastic run), ``hang_timeout=6``, a random ``max_restarts`` (0-2),
and one
fault at a random moment (``chaos_inject.py``): SIGKILL of a rank, of the fork server, of a
node (a ``LocalCluster`` node process, or the Spark executor's Python worker that runs the node
agent), of the caller (then run as a subprocess); SIGSTOP of a rank (past ``hang_timeout``); the
checkpoint tmpfs (1 MiB) filled for a while; short SIGSTOP/SIGCONT pauses (a slow rank); a TCP
connection destroyed with ``ss -K`` (the node's channel to the driver, or a local rank's store
and gloo connections); or none (the control). After each run (``chaos_checks.py``): it
returned in time; nothing of it is alive 10 s later; a success has the right result; a resumed
stream saw every sample exactly once; no checkpoint loaded failed its digest; a failure is the
fault's own error, naming the rank, signal or node.

It prints a table per fault kind (runs, struck, survived, failed with the right error,
violations) and every violation; the exit code is 1 if there was any.

    python benchmarks/chaos.py --minutes 3 --seed 1      # the CI smoke
    python benchmarks/chaos.py --minutes 60 --seed 7 --faults kill-rank,stop-rank
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import chaos_procs as procs
import chaos_workloads
from _common import BENCH_TAG_VAR, load_average, log, version_of
from chaos_checks import Outcome, judge
from chaos_plan import FAULTS, LABELS, WORKLOADS, kinds, plan
from chaos_runner import Context, SoakAborted, execute, execute_caller_kill

#: Seconds after a run within which everything it started must be gone.
LEFTOVER_GRACE = 10.0
#: A run is not started with less than this left of the soak's minutes.
LAST_START = 25.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="how long to run")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's seed")
    parser.add_argument("--spark", dest="spark", action="store_true", default=True)
    parser.add_argument("--no-spark", dest="spark", action="store_false", help="no Spark runs")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated kinds")
    parser.add_argument("--runs", type=int, default=0, help="stop after this many runs (0: time)")
    return parser.parse_args(argv)


def _choices(text: str, known: Sequence[str], what: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return chosen


def _start_spark() -> tuple[Any, str]:
    """The Spark session, or ``None`` and why not."""
    if shutil.which("java") is None:
        return None, "no java on PATH"
    try:
        import cloudpickle
        from spark_launch import start_session

        cloudpickle.register_pickle_by_value(chaos_workloads)  # executors cannot import it
        log("starting local-cluster[2,1,1024]")
        return start_session()[0], ""
    except Exception as error:
        return None, f"{type(error).__name__}: {error}"


def _stop_spark(spark: Any) -> None:
    from spark_launch import shutdown_gateway, stop_session

    stop_session(spark)
    shutdown_gateway()


def _warm(workloads: list[str]) -> None:
    """The one-time costs, before the first run: fork servers (the caller's and the
    executors'), DeepSpeed's op built."""
    import subprocess

    from sparktrain import launch

    if "deepspeed" in workloads:  # as the docs say: build ops ahead (a first build is ~40 s)
        log("sparktrain doctor --build-ops --cpu")
        command = [sys.executable, "-m", "sparktrain", "doctor", "--build-ops", "--cpu"]
        subprocess.run(command, check=False, stdout=subprocess.DEVNULL)
    launch(os.getpid, num_processes=2, use_gpu=False)  # this caller's fork server starts
    if "spark" in workloads:  # and the executors' Python workers start theirs
        launch(os.getpid, num_processes=2, use_gpu=False, backend="spark")
    time.sleep(3.0)  # and imports torch._dynamo while idle (stress.py waits as long)


def _after(outcome: Outcome, ctx: Context) -> None:
    """The leftover check, the verdict, and a clean slate for the next run."""
    folder = ctx.root / f"run-{outcome.run.index:04d}"
    strays = procs.leftovers(LEFTOVER_GRACE)
    if strays:
        outcome.violations += [
            f"left running {LEFTOVER_GRACE:g}s after the run: {procs.describe(p, c)}"
            for p, c in sorted(strays.items())
        ]
        procs.kill_all(list(strays))
    judge(outcome, folder)
    shutil.rmtree(ctx.ckpt_root / folder.name, ignore_errors=True)
    if outcome.status != "violation":
        shutil.rmtree(folder, ignore_errors=True)  # kept for a look when something broke


def _line(outcome: Outcome) -> str:
    result = outcome.result
    attempts = f", {result.attempts} attempt(s)" if hasattr(result, "attempts") else ""
    struck = outcome.injected or "not struck (the run ended first)"
    if outcome.run.fault == "none":
        struck = "no fault"
    error = outcome.error
    said = f"; {type(error).__name__}: {str(error).splitlines()[0][:120]}" if error else ""
    took = f"{outcome.status}{attempts} in {outcome.seconds:.1f}s"
    return f"{outcome.run.describe()}: {took}; {struck}{said}"


def soak(
    args: argparse.Namespace,
    ctx: Context,
    kinds_: tuple[list[str], list[str]],
    began: float,
    outcomes: list[Outcome],
) -> None:
    """Run the schedule until the minutes (or ``--runs``) are used, adding each outcome."""
    deadline = began + args.minutes * 60 - LAST_START
    schedule = plan(args.seed, args.runs or 100_000, *kinds_)
    for run in schedule:
        if not args.runs and time.monotonic() > deadline:
            break
        strike = execute_caller_kill if run.fault == "kill-caller" else execute
        outcome = strike(run, ctx)
        _after(outcome, ctx)
        log(_line(outcome))
        for violation in outcome.violations:
            log(f"  VIOLATION: {violation}")
        outcomes.append(outcome)


def table(outcomes: list[Outcome], faults: list[str]) -> list[str]:
    """The per-fault-kind table, then every violation."""
    header = ("fault", "runs", "struck", "survived", "failed right", "violations")
    lines = ["  {:<32} {:>5} {:>7} {:>9} {:>13} {:>11}".format(*header)]
    for fault in faults:
        mine = [o for o in outcomes if o.run.fault == fault]
        count = {s: sum(o.status == s for o in mine) for s in ("survived", "failed right")}
        struck = sum(bool(o.injected) for o in mine)
        bad = sum(len(o.violations) for o in mine)
        lines.append(
            f"  {LABELS[fault]:<32} {len(mine):>5} {struck:>7} {count['survived']:>9} "
            f"{count['failed right']:>13} {bad:>11}"
        )
    for outcome in outcomes:
        for violation in outcome.violations:
            lines.append(f"  violation in {outcome.run.describe()}: {violation}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ[BENCH_TAG_VAR] = uuid.uuid4().hex  # every process of the soak carries it
    workloads = _choices(args.workloads, WORKLOADS, "workloads")
    faults = _choices(args.faults, list(FAULTS), "faults")
    began = time.monotonic()
    print(
        f"sparktrain chaos soak, {time.strftime('%Y-%m-%d')}: seed {args.seed}, "
        f"{args.minutes:g} min; Python {sys.version.split()[0]}, torch {version_of('torch')}, "
        f"{os.cpu_count()} CPUs, load {load_average()}",
        flush=True,
    )
    root = Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    disk = procs.Disk(root)
    spark, aborted = None, ""
    outcomes: list[Outcome] = []
    try:
        if not disk.mounted and "disk-full" in faults:
            faults.remove("disk-full")
            print(f"  skipped fault 'disk full at a checkpoint': {disk.why_not}")
        if "spark" in workloads and args.spark:
            spark, why = _start_spark()
            if spark is None:
                print(f"  skipped workload 'spark': {why}")
        if spark is None and "spark" in workloads:
            workloads.remove("spark")
        faults = kinds(workloads, faults)
        _warm(workloads)
        data_dir = chaos_workloads.write_dataset(root / "data")
        ckpt_root = disk.path if disk.mounted else root / "ckpt"
        ctx = Context(root, data_dir, disk, ckpt_root)
        try:
            soak(args, ctx, (workloads, faults), began, outcomes)
        except SoakAborted as error:
            aborted = str(error)
    finally:
        if spark is not None:
            _stop_spark(spark)
        disk.close()
    return _report(outcomes, faults, aborted, root, began)


def _report(
    outcomes: list[Outcome], faults: list[str], aborted: str, root: Path, began: float
) -> int:
    from sparktrain.node.warm import shutdown

    shutdown()  # this caller's idle fork server
    print(f"\n{len(outcomes)} runs, 2 ranks each (a row: the runs of one fault kind)")
    print("\n".join(table(outcomes, faults)))
    strays = procs.leftovers(5.0)
    print(f"\nLeftover processes at the end of the soak: {len(strays)}")
    for pid, cmd in strays.items():
        print(f"  {procs.describe(pid, cmd)}")
    procs.kill_all(list(strays))
    if aborted:
        print(f"\nABORTED: {aborted}")
    kept = sorted(p.name for p in root.glob("run-*"))
    if kept:
        print(f"Folders of the runs with violations kept under {root}: {', '.join(kept)}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    print(f"Total time: {time.monotonic() - began:.0f} s; load at the end {load_average()}")
    bad = sum(len(o.violations) for o in outcomes) + len(strays) + bool(aborted)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
