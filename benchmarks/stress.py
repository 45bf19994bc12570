"""Stress benchmark of the run path: launches the way users hammer them; 0 hangs is the bar.

In one caller, 2-rank launches (local backend unless said), each with ``timeout=60``: a run the
timeout stops counts as a hang. Rows:

* each plain pattern of ``stress_patterns.PLAIN`` 1,000 times back to back (destroy then return;
  return without destroy; return the DDP model; an exception after ``init_process_group``;
  init/destroy twice);
* FSDP2, a DeepSpeed engine and Lightning's ``Trainer.fit``, 100 times each;
* destroy-then-return 200 times with a random 0-1 s pause between runs;
* destroy-then-return 200 times from two threads at once (concurrent launches);
* destroy-then-return 100 times on a ``local-cluster[2,1,1024]`` Spark session;
* Spark ML (``stress_sparkml.py``): ``TorchEstimator.fit`` 30 times, ``TorchModel.transform``
  90 times, a fit and a transform from two threads at once 30 times, on that session; and a
  caller SIGKILLed in the middle of a fit, 10 times (nothing it started may be alive 20 s later);
* the caller SIGKILLed at a random moment of a launch (0-2.5 s in), 30 times: ranks that
  started after the caller was gone, processes left alive 10 s later, run directories left
  after the next launch.

It prints, per row, runs, hangs, failures (anything but the pattern's expected outcome), and the
median and maximum run time; then the leftover-process check. ``--scale 0.1`` runs a tenth of
every row (a smoke test); ``--only`` picks rows by name prefix (``plain``, ``heavy``, ``pause``,
``concurrent``, ``spark``, ``sparkml``, ``sparkml-kill``, ``kill``).

    python benchmarks/stress.py                 # the full run: about an hour on 2 cores
    python benchmarks/stress.py --scale 0.05    # a few minutes
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import BENCH_TAG_VAR, leftover_processes, load_average, log, stop_strays, version_of
from stress_patterns import HEAVY, PLAIN, SLEEPY_CALLER, Pattern, outcome, rank_records
from stress_table import RUN_TIMEOUT, KillRow, Row, alive

ROWS = {
    "plain": 1000,
    "heavy": 100,
    "pause": 200,
    "concurrent": 200,
    "spark": 100,
    "sparkml": 30,
    "sparkml-kill": 10,
    "kill": 30,
}


#: After the first launch: how long its fork server takes to import torch._dynamo while idle.
WARM_SECONDS = 3.0


def _one(pattern: Pattern, row: Row, **options: Any) -> None:
    from sparktrain import launch

    started = time.monotonic()
    result = outcome(
        pattern,
        lambda: launch(pattern.fn, num_processes=2, use_gpu=False, timeout=RUN_TIMEOUT, **options),
    )
    row.add(result, time.monotonic() - started)
    if result != "ok":
        log(f"{row.label}: run {len(row.durations)}: {result}")


def _repeat(pattern: Pattern, label: str, count: int, **options: Any) -> Row:
    row = Row(label)
    log(f"{label}: {count} runs")
    for _ in range(count):
        _one(pattern, row, **options)
    slowest = sorted(range(len(row.durations)), key=row.durations.__getitem__)[-3:][::-1]
    where = ", ".join(f"#{i + 1} {row.durations[i]:.3f}s" for i in slowest)
    log(f"done:{row.line()} (slowest runs: {where})")  # each row as soon as it is measured
    return row


def plain_rows(count: int) -> list[Row]:
    warm_up = Row("warm-up")
    _one(PLAIN[0], warm_up)  # this caller's fork server starts: reported, not counted
    time.sleep(WARM_SECONDS)  # and, idle, imports torch._dynamo (a launch would wait for it)
    _one(PLAIN[2], warm_up)  # a model comes back: the caller imports torch to unpickle it
    log(
        f"one-time costs, not counted: the caller's first launch (its fork server starts) "
        f"{warm_up.durations[0]:.3f} s; the first that returns a model (the caller imports "
        f"torch) {warm_up.durations[1]:.3f} s"
    )
    return [_repeat(p, p.name, count) for p in PLAIN]


def heavy_rows(count: int) -> list[Row]:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:  # as the docs say: build ops ahead
        log("sparktrain doctor --build-ops")
        command = [sys.executable, "-m", "sparktrain", "doctor", "--build-ops", "--cpu"]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return [_repeat(p, p.name, count) for p in HEAVY]


def pause_row(count: int) -> list[Row]:
    row = Row("destroy, then return; 0-1 s pauses")
    log(f"{row.label}: {count} runs")
    for _ in range(count):
        time.sleep(random.uniform(0.0, 1.0))
        _one(PLAIN[0], row)
    log(f"done:{row.line()}")
    return [row]


def concurrent_row(count: int) -> list[Row]:
    row = Row("destroy, then return; 2 threads at once")
    log(f"{row.label}: {count} runs")

    def worker(runs: int) -> None:
        for _ in range(runs):
            _one(PLAIN[0], row)

    threads = [threading.Thread(target=worker, args=(n,)) for n in (count // 2, count - count // 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    log(f"done:{row.line()}")
    return [row]


def spark_row(count: int) -> list[Row]:
    import cloudpickle
    import stress_patterns
    from spark_launch import shutdown_gateway, start_session, stop_session

    cloudpickle.register_pickle_by_value(stress_patterns)  # executors cannot import it
    log("starting local-cluster[2,1,1024]")
    spark, _, _ = start_session()
    try:
        _one(PLAIN[0], Row("warm-up"), backend="spark")  # the executors' first import of torch
        return [_repeat(PLAIN[0], "destroy, then return; on Spark", count, backend="spark")]
    finally:
        stop_session(spark)
        shutdown_gateway()


# -- the caller killed at random moments --------------------------------------------------


def kill_row(count: int) -> KillRow:
    from sparktrain import launch
    from sparktrain.node import memory as node_memory

    row = KillRow()
    log(f"caller SIGKILLed at a random moment: {count} trials")
    with tempfile.TemporaryDirectory(prefix="stress-kill-") as tmp:
        script = Path(tmp, "caller.py")
        script.write_text(SLEEPY_CALLER)
        for trial in range(count):
            folder = Path(tmp, f"trial-{trial}")
            folder.mkdir()
            caller = subprocess.Popen([sys.executable, str(script), str(folder)])
            time.sleep(random.uniform(0.0, 2.5))
            caller.kill()
            killed_at = time.time()
            caller.wait()
            time.sleep(3.0)  # a server that was still importing torch has finished by now
            records = rank_records(folder)
            row.late_starts += sum(1 for r in records if r[2] > killed_at + 0.2)
            pids = [pid for r in records for pid in r[:2]]
            deadline = time.monotonic() + 10.0
            while any(alive(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            row.survivors += sum(1 for p in pids if alive(p))
            launch(os.getpid, num_processes=1, use_gpu=False)  # sweeps dead callers' dirs
            left = [  # its run directories, and its nodes' checkpoint memory (/dev/shm)
                path
                for root in {tempfile.gettempdir(), node_memory.root()}
                for path in Path(root).glob(f"sparktrain-*-{caller.pid}-*")
            ]
            row.dirs_left += len(left)
            row.trials += 1
    return row


# -- the table ------------------------------------------------------------------------------


def sparkml_rows(count: int) -> list[Row]:
    import stress_sparkml

    return stress_sparkml.rows(count)


def sparkml_kill_rows(count: int) -> list[Row]:
    import stress_sparkml

    return stress_sparkml.kill_rows(count)


RUNNERS: dict[str, Callable[[int], list[Row]]] = {
    "plain": plain_rows,
    "heavy": heavy_rows,
    "pause": pause_row,
    "concurrent": concurrent_row,
    "spark": spark_row,
    "sparkml": sparkml_rows,
    "sparkml-kill": sparkml_kill_rows,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of every row's runs")
    parser.add_argument("--only", default=",".join(ROWS), help="rows to run, comma-separated")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ[BENCH_TAG_VAR] = uuid.uuid4().hex
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    started = time.monotonic()
    print(
        f"sparktrain stress, {time.strftime('%Y-%m-%d')}: Python {sys.version.split()[0]}, "
        f"torch {version_of('torch')}, {os.cpu_count()} CPUs, load {load_average()}",
        flush=True,
    )
    rows: list[Row] = []
    killed: KillRow | None = None
    for name in chosen:
        count = max(1, round(ROWS[name] * args.scale))
        if name == "kill":
            killed = kill_row(count)
        else:
            rows += RUNNERS[name](count)
    print(f"\n2-rank launches, timeout={RUN_TIMEOUT:g}s each (a run it stops is a hang)")
    header = ("pattern", "runs", "hangs", "failures", "median s", "max s")
    print("  {:<44} {:>6} {:>6} {:>9} {:>9} {:>8}".format(*header))
    for row in rows:
        print(row.line())
    for row in rows:
        for failure in sorted(set(row.failures)):
            print(f"  failure in '{row.label}': {failure}")
    if killed is not None:
        print(
            f"\nCaller SIGKILLed 0-2.5 s into a launch, {killed.trials} trials: ranks started "
            f"after the kill {killed.late_starts}, processes alive 10 s later "
            f"{killed.survivors}, run directories left after the next launch {killed.dirs_left}"
        )
    strays, _ = leftover_processes(5.0)
    forkservers = {p: c for p, c in strays.items() if "sparktrain.node.forkserver" in c}
    others = {p: c for p, c in strays.items() if p not in forkservers}
    print(f"\nLeftover processes (idle fork servers of this caller not counted): {len(others)}")
    for pid, cmd in others.items():
        print(f"  {pid} {cmd[:120]}")
    stop_strays(others)
    print(f"Total time: {time.monotonic() - started:.0f} s; load at the end {load_average()}")
    bad = sum(r.hangs + len(r.failures) for r in rows) + len(others)
    if killed is not None:
        bad += killed.late_starts + killed.survivors + killed.dirs_left
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
