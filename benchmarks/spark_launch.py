"""Spark-mode launch benchmark: the same gloo function on 2 ranks run as Spark barrier tasks.

Everything runs on one ``local-cluster[2,1,1024]`` SparkSession (two executor JVMs, one task
slot each) started once by this script; the session start is reported but not timed in the
table. Three ways of getting work onto both executors at once, each timed as the median of
``--repeat`` calls (default 5) after one untimed warm-up call, in this order:

* floor: a bare barrier job, ``spark.range(0, 2, 1, 2).mapInArrow(f, "x long",
  barrier=True).collect()`` where each task calls ``BarrierTaskContext.get().allGather("x")``
  and yields one row. It is what any barrier launcher pays before it runs a rank. The same job
  through ``sparkContext.parallelize(range(2), 2).barrier().mapPartitions(g).collect()`` is
  timed too, for information; the ``mapInArrow`` one (which sparktrain uses) is the floor.
* pyspark: ``pyspark.ml.torch.distributor.TorchDistributor(2, local_mode=False,
  use_gpu=False).run(gloo_fn)``.
* sparktrain: ``sparktrain.TorchDistributor(2, local_mode=False, use_gpu=False).run(gloo_fn)``.

``gloo_fn`` calls ``dist.init_process_group("gloo")``, all-reduces ``torch.ones(1)``, calls
``dist.destroy_process_group()`` and returns the reduced value (checked to be 2.0). For both
distributors the timed call is constructor plus ``.run``, i.e. the line a user writes.

The warm-up calls are reported on their own lines: sparktrain's first call also starts a fork
server (which imports torch) inside each executor's Python worker, and later calls reuse it.

Then the ratios the project targets, with PASS/MISS (pyspark/sparktrain >= 3, sparktrain/floor
<= 2), and a check for leftover processes once the session is stopped: every process this
benchmark starts (driver and executor JVMs, Python workers, fork servers, ranks) inherits
``SPARKTRAIN_BENCH_TAG``, so other users' processes on the machine are never counted.

Run it from the repository root::

    python benchmarks/spark_launch.py              # full run (a couple of minutes on 2 cores)
    python benchmarks/spark_launch.py --quick      # 3 repetitions, for a smoke test
    python benchmarks/spark_launch.py --repeat 7
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from _common import (
    BENCH_TAG_VAR,
    fmt,
    leftover_processes,
    load_average,
    log,
    print_machine,
    ratio,
    stop_strays,
)

N_PROCS = 2
MASTER = f"local-cluster[{N_PROCS},1,1024]"
FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
EXECUTOR_WAIT_S = 60.0
LEFTOVER_GRACE_S = 10.0
EXPECTED = float(N_PROCS)
MIN_REPEAT = 3


# --------------------------------------------------------------------------------------------
# What the tasks and ranks run (module level, defined in __main__, so they pickle by value).
# --------------------------------------------------------------------------------------------


def gloo_fn() -> float:
    """Rank body: init gloo from the environment, all-reduce ``torch.ones(1)``, destroy."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return float(t.item())


def floor_arrow_task(batches: Iterator[Any]) -> Iterator[Any]:
    """Barrier ``mapInArrow`` task of the floor: one ``allGather``, one row out."""
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    for _ in batches:  # consume the input
        pass
    BarrierTaskContext.get().allGather("x")
    yield pa.RecordBatch.from_pydict({"x": [os.getpid()]})


def floor_rdd_task(rows: Iterator[int]) -> Iterator[int]:
    """Barrier RDD partition of the floor's RDD variant: one ``allGather``, one value out."""
    from pyspark import BarrierTaskContext

    for _ in rows:
        pass
    BarrierTaskContext.get().allGather("x")
    yield os.getpid()


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


@dataclass
class Mode:
    """One row of the table: the warm-up call and the timed calls (seconds)."""

    label: str
    warmup: float | None = None
    samples: list[float] = field(default_factory=list)
    failed: str = ""

    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


def first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:limit] if text else ''}"


# --------------------------------------------------------------------------------------------
# Leftover-process report
# --------------------------------------------------------------------------------------------


def describe(cmd: str) -> str:
    """A short name for a tagged process, for the leftover report."""
    if "CoarseGrainedExecutorBackend" in cmd:
        return "executor JVM"
    if "org.apache.spark.deploy.SparkSubmit" in cmd or "pyspark-shell" in cmd:
        return "driver JVM"
    if "pyspark.daemon" in cmd or "pyspark/daemon" in cmd:
        return "pyspark daemon"
    if "pyspark.worker" in cmd:
        return "pyspark worker"
    if "sparktrain.node.forkserver" in cmd:
        return "sparktrain fork server"
    if "torch.distributed.run" in cmd:
        return "torchrun"
    return "other"


def print_strays(title: str, strays: dict[int, str]) -> None:
    print(title)
    for pid, cmd in sorted(strays.items()):
        print(f"  pid {pid} [{describe(cmd)}]: {cmd[:160]}")


# --------------------------------------------------------------------------------------------
# The session
# --------------------------------------------------------------------------------------------


def start_session() -> tuple[Any, float, float]:
    """The local-cluster session; (session, getOrCreate seconds, executor wait seconds)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    start = time.perf_counter()
    spark = (
        SparkSession.builder.master(MASTER)
        .appName("sparktrain-spark-bench")
        .config("spark.executor.memory", "512m")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.extraJavaOptions", FAST_JVM)
        .config("spark.executor.extraJavaOptions", FAST_JVM)
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        .getOrCreate()
    )
    created = time.perf_counter() - start
    spark.sparkContext.setLogLevel("ERROR")
    start = time.perf_counter()
    deadline = time.monotonic() + EXECUTOR_WAIT_S
    while executors_registered(spark) < N_PROCS and time.monotonic() < deadline:
        time.sleep(0.2)
    waited = time.perf_counter() - start
    if executors_registered(spark) < N_PROCS:
        raise RuntimeError(
            f"only {executors_registered(spark)} of {N_PROCS} executors registered "
            f"within {EXECUTOR_WAIT_S:.0f}s"
        )
    return spark, created, waited


def executors_registered(spark: Any) -> int:
    """Executors (the driver is not counted) known to the block manager."""
    return int(spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()) - 1


def stop_session(spark: Any) -> None:
    spark.stop()


def shutdown_gateway() -> int | None:
    """Stop the driver JVM (pyspark's Py4J gateway), which ``spark.stop()`` leaves running.

    Returns its exit code, or ``None`` if there was none to stop.
    """
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None:
        return None
    proc = getattr(gateway, "proc", None)
    with contextlib.suppress(Exception):
        gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc is None:
        return None
    with contextlib.suppress(Exception):
        proc.stdin.close()  # the gateway server exits at EOF on its stdin
    try:
        return int(proc.wait(timeout=LEFTOVER_GRACE_S))
    except Exception:
        proc.kill()
        return int(proc.wait(timeout=LEFTOVER_GRACE_S))


def driver_jvm_pid() -> int | None:
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None) if gateway is not None else None
    return None if proc is None else int(proc.pid)


# --------------------------------------------------------------------------------------------
# The three modes
# --------------------------------------------------------------------------------------------


def floor_arrow(spark: Any) -> Any:
    rows = spark.range(0, N_PROCS, 1, N_PROCS).mapInArrow(floor_arrow_task, "x long", barrier=True)
    return rows.collect()


def floor_rdd(spark: Any) -> Any:
    rdd = spark.sparkContext.parallelize(range(N_PROCS), N_PROCS)
    return rdd.barrier().mapPartitions(floor_rdd_task).collect()


def check_floor(rows: Any) -> None:
    if len(rows) != N_PROCS:
        raise RuntimeError(f"floor job returned {len(rows)} rows, expected {N_PROCS}")


def run_pyspark(_spark: Any) -> Any:
    from pyspark.ml.torch.distributor import TorchDistributor

    return TorchDistributor(num_processes=N_PROCS, local_mode=False, use_gpu=False).run(gloo_fn)


def run_sparktrain(_spark: Any) -> Any:
    import sparktrain

    distributor = sparktrain.TorchDistributor(
        num_processes=N_PROCS, local_mode=False, use_gpu=False
    )
    return distributor.run(gloo_fn)


def check_gloo(value: Any) -> None:
    if value != EXPECTED:
        raise RuntimeError(f"rank 0 returned {value!r}, expected {EXPECTED!r}")


def time_mode(
    mode: Mode,
    spark: Any,
    call: Callable[[Any], Any],
    check: Callable[[Any], None],
    repeat: int,
) -> None:
    """One warm-up call, then ``repeat`` timed calls; a failure is recorded, not raised."""
    for i in range(1 + repeat):
        start = time.perf_counter()
        try:
            check(call(spark))
        except Exception as exc:
            mode.failed = f"call {i} ({'warm-up' if i == 0 else 'timed'}): {first_line(exc)}"
            print(f"NOTE: {mode.label} failed on {mode.failed}\n{exc}", flush=True)
            return
        elapsed = time.perf_counter() - start
        if i == 0:
            mode.warmup = elapsed
        else:
            mode.samples.append(elapsed)
        log(f"    {'warm-up' if i == 0 else f'run {i}'}: {elapsed:.3f}s")


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def print_table(modes: dict[str, Mode], repeat: int) -> None:
    print(f"Spark launch time on {MASTER}, N={N_PROCS} ranks, median of {repeat} (seconds)")
    print(f"  {'':<52} {'median':>8}   samples")
    for mode in modes.values():
        detail = (
            f"FAILED {mode.failed}" if mode.failed else " ".join(f"{s:.2f}" for s in mode.samples)
        )
        print(f"  {mode.label:<52} {fmt(mode.median()):>8}   {detail}")
    print("First (warm-up) call, not in the medians")
    for mode in modes.values():
        print(f"  {mode.label:<52} {fmt(mode.warmup):>8}")
    print()


def print_ratios(modes: dict[str, Mode]) -> None:
    floor = modes["floor"].median()
    pyspark = modes["pyspark"].median()
    ours = modes["sparktrain"].median()
    targets = [
        ("pyspark / sparktrain", ratio(pyspark, ours), ">=", 3.0),
        ("sparktrain / floor", ratio(ours, floor), "<=", 2.0),
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
    info = [
        ("pyspark / floor", ratio(pyspark, floor)),
        ("sparktrain - floor (seconds)", None if ours is None or floor is None else ours - floor),
        ("floor rdd / floor mapInArrow", ratio(modes["floor_rdd"].median(), floor)),
        ("sparktrain warm-up / sparktrain median", ratio(modes["sparktrain"].warmup, ours)),
        ("pyspark warm-up / pyspark median", ratio(modes["pyspark"].warmup, pyspark)),
    ]
    for name, value in info:
        print(f"  {name:<40} {fmt(value):>8}")
    print(flush=True)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def measure_all(spark: Any, repeat: int) -> dict[str, Mode]:
    modes = {
        "floor": Mode("floor: barrier mapInArrow + allGather"),
        "floor_rdd": Mode("floor (info): barrier RDD mapPartitions + allGather"),
        "pyspark": Mode("pyspark TorchDistributor(2, False, False).run"),
        "sparktrain": Mode("sparktrain TorchDistributor(2, False, False).run"),
    }
    plan: list[tuple[str, Callable[[Any], Any], Callable[[Any], None]]] = [
        ("floor", floor_arrow, check_floor),
        ("floor_rdd", floor_rdd, check_floor),
        ("pyspark", run_pyspark, check_gloo),
        ("sparktrain", run_sparktrain, check_gloo),
    ]
    for key, call, check in plan:
        log(modes[key].label)
        time_mode(modes[key], spark, call, check, repeat)
    return modes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--repeat", type=int, default=5, help=f"timed calls per mode (default 5, min {MIN_REPEAT})"
    )
    parser.add_argument("--quick", action="store_true", help="3 timed calls, for a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat = MIN_REPEAT
    if args.repeat < MIN_REPEAT:
        parser.error(f"--repeat must be at least {MIN_REPEAT}")
    return args


def check_leftovers() -> None:
    """After ``spark.stop()``: nothing tagged but the driver JVM; then stop that one too."""
    jvm = driver_jvm_pid()
    exclude = frozenset({jvm}) if jvm is not None else frozenset()
    strays, waited = leftover_processes(LEFTOVER_GRACE_S, exclude)
    if strays:
        print_strays(
            f"WARNING: still running {LEFTOVER_GRACE_S:.0f}s after spark.stop() "
            "(driver JVM not counted; now terminated):",
            strays,
        )
        stop_strays(strays)
    else:
        print(f"Executors, Python workers and ranks gone {waited:.1f}s after spark.stop().")
    code = shutdown_gateway()
    log(f"driver JVM (Py4J gateway) stopped, exit code {code}")
    strays, _ = leftover_processes(LEFTOVER_GRACE_S)
    if strays:
        print_strays("WARNING: leftover processes after the benchmark (now terminated):", strays)
        stop_strays(strays)
    else:
        print("No leftover processes.")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ[BENCH_TAG_VAR] = uuid.uuid4().hex
    started = time.perf_counter()
    print_machine("torch", "pyspark", "pyarrow")
    log(f"starting {MASTER}")
    spark = None
    modes: dict[str, Mode] | None = None
    try:
        spark, created, waited = start_session()
        print(
            f"Session start (not in the table): getOrCreate {created:.3f}s, "
            f"then {waited:.3f}s until both executors registered",
            flush=True,
        )
        modes = measure_all(spark, args.repeat)
    finally:
        if spark is not None:
            log("stopping the session")
            stop_start = time.perf_counter()
            stop_session(spark)
            log(f"spark.stop() took {time.perf_counter() - stop_start:.3f}s")
        print()
        if modes is not None:
            print_table(modes, args.repeat)
            print_ratios(modes)
        check_leftovers()
        print(f"Load average at the end: {load_average()}")
        print(f"Total benchmark time: {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
