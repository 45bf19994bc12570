"""Launch-overhead benchmark: how long it takes to get N=2 torch ranks to run a function.

Two workloads, each timed as the median of ``--repeat`` repetitions (default 5):

* ``noop``: each rank imports torch and returns (nothing else);
* ``gloo``: each rank calls ``dist.init_process_group("gloo")``, all-reduces ``torch.ones(1)``
  and calls ``dist.destroy_process_group()``.

Five ways of running them, one row each:

(a) floor: 2 parallel ``python -c "import torch, torch.distributed"`` subprocesses (start both,
    wait for both). The same number is shown for both workloads.
(b) ``python -m torch.distributed.run --standalone --nproc_per_node=2 SCRIPT`` on an
    equivalent script written to a temp dir.
(c) ``pyspark.ml.torch.distributor.TorchDistributor(2, local_mode=True, use_gpu=False).run(fn)``
    on a ``local[2]`` SparkSession; only ``.run`` is timed (after one untimed warm-up run), the
    session start is not. Runs in a child process so the JVM is gone when it ends.
(d) sparktrain's first run in a fresh caller: a fresh child process imports sparktrain (torch
    is not imported in the caller) and times just ``TorchDistributor(2, True, False).run(fn)``;
    one fresh child per repetition.
(e) sparktrain's repeated run in one caller: one child process does a warm-up run, then
    ``--repeat`` timed runs.

Then the ratios the project targets, with PASS/MISS, and a check for leftover processes.

Run it from the repository root::

    python benchmarks/launch.py              # full run (a few minutes on 2 cores)
    python benchmarks/launch.py --quick      # 3 repetitions, for a smoke test
    python benchmarks/launch.py --skip-pyspark --repeat 7

The ``--child MODE WORKLOAD`` options are internal: the script re-runs itself in those modes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    BENCH_TAG_VAR,
    fmt,
    load_average,
    log,
    print_machine,
    ratio,
    report_leftovers,
)

N_PROCS = 2
WORKLOADS = ("noop", "gloo")
CHILD_TIMEOUT_S = 300.0
RUN_TIMEOUT_S = 120.0
RESULT_MARKER = "BENCH_RESULT "

NOOP_SCRIPT = "import torch  # noqa: F401\n"
GLOO_SCRIPT = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == float(dist.get_world_size()), t
dist.destroy_process_group()
"""
SCRIPTS = {"noop": NOOP_SCRIPT, "gloo": GLOO_SCRIPT}


# --------------------------------------------------------------------------------------------
# The functions the ranks run (module level, torch imported inside, so they pickle by value).
# --------------------------------------------------------------------------------------------


def noop_fn() -> int:
    """Rank body of the no-op workload: torch is imported, nothing else happens."""
    import torch  # noqa: F401

    return 0


def gloo_fn() -> float:
    """Rank body of the gloo workload: init, all-reduce ``torch.ones(1)``, destroy."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return float(t.item())


RANK_FNS: dict[str, Callable[[], Any]] = {"noop": noop_fn, "gloo": gloo_fn}
EXPECTED: dict[str, Any] = {"noop": 0, "gloo": float(N_PROCS)}


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One row of the table: per-workload samples (seconds), or a reason it has none."""

    label: str
    samples: dict[str, list[float]] = field(default_factory=dict)
    skipped: str = ""

    def median(self, workload: str) -> float | None:
        values = self.samples.get(workload)
        return statistics.median(values) if values else None


def emit_result(payload: dict[str, Any]) -> None:
    """Child side: print the result line the parent parses."""
    print(RESULT_MARKER + json.dumps(payload), flush=True)


def parse_result(stdout: str) -> dict[str, Any]:
    """Parent side: the last result line of a child's stdout."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not lines:
        raise RuntimeError("child printed no result line")
    return dict(json.loads(lines[-1][len(RESULT_MARKER) :]))


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# --------------------------------------------------------------------------------------------
# (a) floor and (b) torchrun
# --------------------------------------------------------------------------------------------


def time_parallel(commands: Sequence[Sequence[str]], env: dict[str, str] | None = None) -> float:
    """Start all commands, wait for all; wall seconds. Raises if one fails."""
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        for cmd in commands
    ]
    errors = [proc.communicate(timeout=RUN_TIMEOUT_S)[1] for proc in procs]
    elapsed = time.perf_counter() - start
    for proc, err in zip(procs, errors, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(proc.args)} exited {proc.returncode}:\n{tail(err.decode())}"  # type: ignore[arg-type]
            )
    return elapsed


def bench_floor(repeat: int) -> list[float]:
    cmd = [sys.executable, "-c", "import torch, torch.distributed"]
    return [time_parallel([cmd] * N_PROCS) for _ in range(repeat)]


def bench_torchrun(workload: str, repeat: int, tmp: Path) -> list[float]:
    script = tmp / f"{workload}.py"
    script.write_text(SCRIPTS[workload])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={N_PROCS}",
        str(script),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # torchrun sets it anyway, with a warning
    return [time_parallel([cmd], env) for _ in range(repeat)]


# --------------------------------------------------------------------------------------------
# Child processes: (c) pyspark, (d) sparktrain first run, (e) sparktrain repeated runs
# --------------------------------------------------------------------------------------------


def run_child(mode: str, workload: str, repeat: int) -> tuple[dict[str, Any], float]:
    """Run this script as ``--child MODE WORKLOAD``; return its result and its outer wall time."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, workload]
    cmd += ["--repeat", str(repeat)]
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    start = time.perf_counter()
    proc = subprocess.run(
        cmd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(
            f"child {mode} {workload} exited {proc.returncode}\n"
            f"--- stderr (tail) ---\n{tail(proc.stderr)}\n"
            f"--- stdout (tail) ---\n{tail(proc.stdout)}"
        )
    return parse_result(proc.stdout), wall


def check_value(workload: str, value: Any) -> None:
    if value != EXPECTED[workload]:
        raise RuntimeError(
            f"{workload}: rank 0 returned {value!r}, expected {EXPECTED[workload]!r}"
        )


def child_sparktrain(workload: str, repeat: int, warm_runs: int) -> None:
    """Child mode for (d) (``warm_runs=0, repeat=1``) and (e): time sparktrain's run calls."""
    from sparktrain import TorchDistributor

    torch_before = "torch" in sys.modules
    fn = RANK_FNS[workload]
    times: list[float] = []
    for i in range(warm_runs + repeat):
        distributor = TorchDistributor(num_processes=N_PROCS, local_mode=True, use_gpu=False)
        start = time.perf_counter()
        value = distributor.run(fn)
        elapsed = time.perf_counter() - start
        check_value(workload, value)
        if i >= warm_runs:
            times.append(elapsed)
    emit_result({"times": times, "torch_in_caller_before_run": torch_before})


def child_pyspark(workload: str, repeat: int) -> None:
    """Child mode for (c): one local[2] SparkSession, one warm-up run, then timed runs."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    start = time.perf_counter()
    spark = (
        SparkSession.builder.master(f"local[{N_PROCS}]")
        .appName("sparktrain-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .getOrCreate()
    )
    session_s = time.perf_counter() - start
    fn = RANK_FNS[workload]
    times: list[float] = []
    try:
        for i in range(1 + repeat):
            distributor = TorchDistributor(num_processes=N_PROCS, local_mode=True, use_gpu=False)
            start = time.perf_counter()
            value = distributor.run(fn)
            elapsed = time.perf_counter() - start
            check_value(workload, value)
            if i >= 1:
                times.append(elapsed)
    finally:
        spark.stop()
    emit_result({"times": times, "session_s": session_s})


def run_as_child(mode: str, workload: str, repeat: int) -> None:
    if mode == "first":
        child_sparktrain(workload, repeat=1, warm_runs=0)
    elif mode == "repeated":
        child_sparktrain(workload, repeat=repeat, warm_runs=1)
    else:
        child_pyspark(workload, repeat)


def bench_first(workload: str, repeat: int) -> tuple[list[float], list[float]]:
    """(d): one fresh child per repetition; returns (timed run calls, outer child walls)."""
    times: list[float] = []
    walls: list[float] = []
    for _ in range(repeat):
        result, wall = run_child("first", workload, 1)
        if result["torch_in_caller_before_run"]:
            raise RuntimeError("torch was imported in the caller before the timed run")
        times.extend(result["times"])
        walls.append(wall)
    return times, walls


def bench_repeated(workload: str, repeat: int) -> list[float]:
    result, _ = run_child("repeated", workload, repeat)
    return list(result["times"])


def bench_pyspark(workload: str, repeat: int) -> tuple[list[float], float]:
    result, _ = run_child("pyspark", workload, repeat)
    return list(result["times"]), float(result["session_s"])


def pyspark_unavailable() -> str:
    """Empty if pyspark's TorchDistributor can be imported, else why not."""
    probe = "import pyspark.ml.torch.distributor, pyspark.sql"
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False, timeout=120
    )
    return "" if proc.returncode == 0 else tail(proc.stderr, 3)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def print_table(rows: Sequence[Row], repeat: int) -> None:
    print(f"Launch time, N={N_PROCS} processes, median of {repeat} (seconds)")
    print(f"  {'':<48} {'no-op':>8} {'gloo':>8}   samples (no-op | gloo)")
    for row in rows:
        cells = [fmt(row.median(w)) for w in WORKLOADS]
        if row.skipped:
            detail = f"skipped: {row.skipped}"
        else:
            detail = " | ".join(
                " ".join(f"{s:.2f}" for s in row.samples.get(w, [])) for w in WORKLOADS
            )
        print(f"  {row.label:<48} {cells[0]:>8} {cells[1]:>8}   {detail}")
    print()


def print_ratios(rows: dict[str, Row]) -> None:
    def m(key: str, workload: str) -> float | None:
        return rows[key].median(workload)

    targets = [
        ("(d)/(a) no-op   first run vs floor", ratio(m("d", "noop"), m("a", "noop")), "<=", 1.0),
        ("(d)/(a) gloo    first run vs floor", ratio(m("d", "gloo"), m("a", "gloo")), "<=", 1.0),
        ("(e)/(a) no-op   repeated run vs floor", ratio(m("e", "noop"), m("a", "noop")), "<=", 0.2),
        ("(c)/(e) gloo    pyspark vs repeated", ratio(m("c", "gloo"), m("e", "gloo")), ">=", 10.0),
    ]
    print("Targets")
    for name, value, op, target in targets:
        if value is None:
            verdict = "n/a"
        else:
            ok = value <= target if op == "<=" else value >= target
            verdict = "PASS" if ok else "MISS"
        print(f"  {name:<40} {fmt(value):>8}   target {op} {target:<5} {verdict}")
    print("For information")
    for key_num, key_den, what in (
        ("b", "e", "torchrun vs repeated"),
        ("c", "d", "pyspark vs first"),
    ):
        for w in WORKLOADS:
            value = ratio(m(key_num, w), m(key_den, w))
            label = f"({key_num})/({key_den}) {w:<6}  {what}"
            print(f"  {label:<40} {fmt(value):>8}")
    print(flush=True)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def measure_all(repeat: int, skip_pyspark: bool) -> dict[str, Row]:
    rows = {
        "a": Row("(a) floor: 2x 'import torch, torch.distributed'"),
        "b": Row("(b) torchrun --standalone --nproc_per_node=2"),
        "c": Row("(c) pyspark TorchDistributor.run"),
        "d": Row("(d) sparktrain first run (fresh caller)"),
        "e": Row("(e) sparktrain repeated run (same caller)"),
    }
    log("(a) floor")
    floor = bench_floor(repeat)
    rows["a"].samples = {w: floor for w in WORKLOADS}
    with tempfile.TemporaryDirectory(prefix="sparktrain-bench-") as tmp:
        for w in WORKLOADS:
            log(f"(b) torchrun {w}")
            rows["b"].samples[w] = bench_torchrun(w, repeat, Path(tmp))
    for w in WORKLOADS:
        log(f"(d) sparktrain first run {w}")
        rows["d"].samples[w], walls = bench_first(w, repeat)
        wall = fmt(statistics.median(walls))
        log(f"    outer wall of each fresh caller (start, run, exit): median {wall}")
        log(f"(e) sparktrain repeated run {w}")
        rows["e"].samples[w] = bench_repeated(w, repeat)
    rows["c"].skipped = "--skip-pyspark" if skip_pyspark else pyspark_unavailable()
    if rows["c"].skipped:
        print(f"NOTE: (c) pyspark was skipped: {rows['c'].skipped}", flush=True)
        return rows
    for w in WORKLOADS:
        log(f"(c) pyspark {w}")
        try:
            rows["c"].samples[w], session_s = bench_pyspark(w, repeat)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            rows["c"].skipped = f"pyspark failed ({w}); see the message above"
            print(f"NOTE: (c) pyspark failed for {w}:\n{exc}", flush=True)
            break
        log(f"    SparkSession start (not timed in the table): {session_s:.3f}s")
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=5, help="repetitions per cell (default 5)")
    parser.add_argument("--quick", action="store_true", help="3 repetitions, for a smoke test")
    parser.add_argument("--skip-pyspark", action="store_true", help="do not measure row (c)")
    parser.add_argument(
        "--child", nargs=2, metavar=("MODE", "WORKLOAD"), help=argparse.SUPPRESS, default=None
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat = 3
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.child and (
        args.child[0] not in ("first", "repeated", "pyspark") or args.child[1] not in WORKLOADS
    ):
        parser.error(f"bad --child {args.child}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        run_as_child(args.child[0], args.child[1], args.repeat)
        return 0
    os.environ[BENCH_TAG_VAR] = uuid.uuid4().hex
    started = time.perf_counter()
    print_machine("torch", "pyspark")
    rows = measure_all(args.repeat, args.skip_pyspark)
    print_table(list(rows.values()), args.repeat)
    print_ratios(rows)
    report_leftovers()
    print(f"Load average at the end: {load_average()}")
    print(f"Total benchmark time: {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
