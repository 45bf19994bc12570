"""Search benchmark: the same 8-trial search through ``sparktrain.tune`` and through Ray Tune.

Both sides run the same grid of 8 learning rates (:data:`LRS`), one trial at a time, each trial a
2-rank DDP job (gloo, CPU) training the seeds' MLP (784-512-256-10, SGD) for ``--epochs`` epochs
of :data:`STEPS_PER_EPOCH` steps on the same synthetic batches (a fixed random teacher labels
them, so the loss falls and the learning rate matters). Every epoch, the ranks all-reduce their
mean loss and report it; no scheduler stops anything early, so both sides do exactly the same
work, and the shared rank body (:func:`train_body`) makes both sides find the same losses.

(a) sparktrain: ``sparktrain.tune(main, {"lr": LRS, ...}, num_trials=8, metric="loss",
    num_processes_per_trial=2, scheduler=None, sampler=optuna.samplers.GridSampler(...))`` on
    the local backend, in a fresh child process, so the first (cold) launch is in the time.
    Ranks report with ``sparktrain.report(step=epoch, loss=...)``.
(b) Ray Tune + Ray Train: a fresh child process starts a local cluster with
    ``ray.init(address="local", num_cpus=4)`` (timed apart from the search), then runs
    ``ray.tune.Tuner`` over ``tune.grid_search(LRS)`` with ``max_concurrent_trials=1``. Ray 2.60
    has Train V2 on by default (``RAY_TRAIN_V2_ENABLED=1``; the script sets it explicitly), where
    passing a ``TorchTrainer`` to a ``Tuner`` is deprecated: instead each Tune trial is a
    function trainable (1 CPU) that builds ``TorchTrainer(worker_fn, train_loop_config=config,
    scaling_config=ScalingConfig(num_workers=2, use_gpu=False), run_config=RunConfig(...,
    callbacks=[ray.tune.integration.ray_train.TuneReportCallback()]))`` and calls ``.fit()``;
    the Train controller actor takes 0 CPUs and each worker 1, so a trial needs 3 logical CPUs
    and 4 leave room for exactly one trial (the machine has 2 cores, so concurrency 1 on both
    sides). Workers report with ``ray.train.report({"loss": ...})``; the callback forwards rank
    0's metrics to the Tune trial. Two settings only help Ray: the dashboard is off
    (``include_dashboard=False``; it costs CPU on a 2-core machine) and ``reuse_actors=True``
    (the trials share one trainable actor; the Train workers are still new per trial, as
    ``fit()`` makes them). Then ``ray.shutdown()`` (timed too).

Every process either side starts carries the run's tag (see ``_common.py``), so the script checks,
after each side, that nothing of it is left running (Ray's raylet, GCS and workers included).

Run it from the repository root::

    python benchmarks/tune.py               # full run (about 6 min on 2 busy cores, mostly Ray)
    python benchmarks/tune.py --epochs 2    # shorter trials
    python benchmarks/tune.py --skip-ray    # sparktrain only

The ``--child SIDE`` option is internal: the script re-runs itself in that mode.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from _common import (
    BENCH_TAG_VAR,
    fmt,
    leftover_processes,
    load_average,
    log,
    ratio,
    stop_strays,
    tagged_processes,
    version_of,
)

N_PROCS = 2
LRS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7)
NUM_TRIALS = len(LRS)
STEPS_PER_EPOCH = 4
BATCH_PER_RANK = 32
DEFAULT_EPOCHS = 5
RAY_NUM_CPUS = 4
CONCURRENT_TRIALS = 1
CHILD_TIMEOUT_S = 900.0
RESULT_MARKER = "BENCH_RESULT "
TARGET_RATIO = 3.0


# --------------------------------------------------------------------------------------------
# The rank body both sides run (module level, torch imported inside, so it pickles by value)
# --------------------------------------------------------------------------------------------


def train_body(config: dict[str, Any], report: Callable[[int, float], None]) -> float:
    """Train the MLP with ``config["lr"]``; call ``report(epoch, loss)`` each epoch.

    Joins the process group with gloo unless the caller (Ray Train) already did. The loss of an
    epoch is the mean over its steps and over the ranks, so every rank reports the same number.

    Returns:
        The last epoch's loss.
    """
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)  # 2 ranks on 2 cores, the same on both sides
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps, batch = int(config["steps_per_epoch"]), int(config["batch_per_rank"])
    data = torch.Generator().manual_seed(1234)
    x = torch.randn(steps, world, batch, 784, generator=data)
    teacher = torch.randn(784, 10, generator=data)
    y = (x @ teacher).argmax(dim=-1)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                      nn.Linear(256, 10))
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    loss_value = float("nan")
    for epoch in range(1, int(config["epochs"]) + 1):
        total = torch.zeros(1)
        for step in range(steps):
            loss = nn.functional.cross_entropy(model(x[step, rank]), y[step, rank])
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            total += loss.detach()
        dist.all_reduce(total)
        loss_value = total.item() / (steps * world)
        report(epoch, loss_value)
    if own_group:
        # The DDP model first: a Reducer freed after its gloo group was destroyed can deadlock
        # (the group's destructor joins a gloo thread that waits for the GIL; torch 2.13).
        del model, optimizer
        dist.destroy_process_group()
    return loss_value


def sparktrain_main(config: dict[str, Any]) -> dict[str, float]:
    """Rank function of a sparktrain trial."""
    import sparktrain

    def report(epoch: int, loss: float) -> None:
        sparktrain.report(step=epoch, total=int(config["epochs"]), loss=loss)

    return {"loss": train_body(config, report)}


def ray_worker(config: dict[str, Any]) -> None:
    """Per-worker function of a Ray Train run (Ray has set up the gloo group)."""
    import ray.train

    def report(epoch: int, loss: float) -> None:
        ray.train.report({"loss": loss, "epoch": epoch})

    train_body(config, report)


def ray_trial(config: dict[str, Any]) -> None:
    """Tune function trainable of one trial: a 2-worker ``TorchTrainer`` run (Train V2 style)."""
    import ray.train
    import ray.tune
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    trainer = TorchTrainer(
        ray_worker,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=N_PROCS, use_gpu=False),
        run_config=ray.train.RunConfig(
            name=f"train-{ray.tune.get_context().get_trial_id()}",
            storage_path=config["storage_path"],
            callbacks=[TuneReportCallback()],
        ),
    )
    trainer.fit()


# --------------------------------------------------------------------------------------------
# Child processes: one side each
# --------------------------------------------------------------------------------------------


def constants(epochs: int) -> dict[str, Any]:
    """The configuration every trial shares (the searched ``lr`` is added per trial)."""
    return {"epochs": epochs, "steps_per_epoch": STEPS_PER_EPOCH, "batch_per_rank": BATCH_PER_RANK}


def emit_result(payload: dict[str, Any]) -> None:
    """Child side: print the result line the parent parses."""
    print(RESULT_MARKER + json.dumps(payload), flush=True)


def _grid_sampler_class() -> Any:
    """``optuna.samplers.GridSampler`` without its ``study.stop()`` once the grid is done.

    Optuna's GridSampler calls ``study.stop()`` from ``after_trial`` when the last grid point
    finishes, which raises outside ``study.optimize`` (``sparktrain.tune`` uses ask and tell);
    stopping is moot here since ``num_trials`` equals the grid's size.
    """
    import optuna

    class GridSampler(optuna.samplers.GridSampler):
        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    return GridSampler


def child_sparktrain(epochs: int) -> None:
    """Run the search through ``sparktrain.tune`` on the local backend."""
    started = time.perf_counter()
    import optuna

    import sparktrain

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    _GridSampler = _grid_sampler_class()
    import_s = time.perf_counter() - started
    space: dict[str, Any] = {"lr": list(LRS), **constants(epochs)}
    started = time.perf_counter()
    result = sparktrain.tune(
        sparktrain_main,
        space,
        num_trials=NUM_TRIALS,
        metric="loss",
        mode="min",
        max_concurrent_trials=CONCURRENT_TRIALS,
        num_processes_per_trial=N_PROCS,
        scheduler=None,
        sampler=_GridSampler({"lr": list(LRS)}),
    )
    search_s = time.perf_counter() - started
    print(result.table(), file=sys.stderr, flush=True)
    trials = [
        {"lr": t.config["lr"], "loss": t.value, "state": t.state, "seconds": t.duration}
        for t in result.trials
    ]
    best = result.best_config or {}
    emit_result(
        {
            "import_s": import_s,
            "start_s": 0.0,
            "search_s": search_s,
            "shutdown_s": 0.0,
            "trials": trials,
            "best_lr": best.get("lr"),
            "best_loss": result.best_value,
        }
    )


def child_ray(epochs: int) -> None:
    """Start a local Ray cluster, run the search through Ray Tune + TorchTrainer, shut down."""
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.pop("RAY_ADDRESS", None)  # never join someone else's cluster
    started = time.perf_counter()
    import ray
    import ray.train
    import ray.tune
    from ray.train.torch import TorchTrainer  # noqa: F401  (imported here to time it)

    import_s = time.perf_counter() - started
    tmp = tempfile.mkdtemp(prefix="stb-ray-", dir="/tmp")  # short: Ray's socket paths
    try:
        started = time.perf_counter()
        ray.init(
            address="local",
            num_cpus=RAY_NUM_CPUS,
            include_dashboard=False,
            _temp_dir=os.path.join(tmp, "t"),
            log_to_driver=False,
        )
        start_s = time.perf_counter() - started
        ray_processes = len(tagged_processes())
        try:
            config: dict[str, Any] = {
                "lr": ray.tune.grid_search(list(LRS)),
                "storage_path": os.path.join(tmp, "results"),
                **constants(epochs),
            }
            tuner = ray.tune.Tuner(
                ray_trial,
                param_space=config,
                tune_config=ray.tune.TuneConfig(
                    metric="loss",
                    mode="min",
                    max_concurrent_trials=CONCURRENT_TRIALS,
                    reuse_actors=True,  # one trainable actor for all trials: helps Ray
                ),
                run_config=ray.tune.RunConfig(
                    name="tune", storage_path=os.path.join(tmp, "results"), verbose=0
                ),
            )
            started = time.perf_counter()
            grid = tuner.fit()
            search_s = time.perf_counter() - started
        finally:
            started = time.perf_counter()
            ray.shutdown()
            shutdown_s = time.perf_counter() - started
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if grid.errors:
        raise RuntimeError(f"{len(grid.errors)} Ray trial(s) failed: {grid.errors[0]!r}")
    trials = [
        {"lr": r.config["lr"], "loss": r.metrics.get("loss"), "state": "complete",
         "seconds": r.metrics.get("time_total_s")}
        for r in grid
    ]  # fmt: skip
    best = grid.get_best_result(metric="loss", mode="min", scope="last")
    emit_result(
        {
            "import_s": import_s,
            "start_s": start_s,
            "search_s": search_s,
            "shutdown_s": shutdown_s,
            "trials": trials,
            "best_lr": best.config["lr"],
            "best_loss": best.metrics["loss"],
            "ray_processes": ray_processes,
        }
    )


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_side(side: str, epochs: int) -> dict[str, Any]:
    """Run this script as ``--child SIDE``; its result, with its outer wall time as ``wall_s``."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", side, "--epochs", str(epochs)]
    started = time.perf_counter()
    proc = subprocess.run(
        cmd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    wall_s = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(
            f"child {side} exited {proc.returncode}\n--- stderr (tail) ---\n{tail(proc.stderr)}"
            f"\n--- stdout (tail) ---\n{tail(proc.stdout)}"
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not lines:
        raise RuntimeError(f"child {side} printed no result line:\n{tail(proc.stdout)}")
    result = dict(json.loads(lines[-1][len(RESULT_MARKER) :]))
    result["wall_s"] = wall_s
    result["total_s"] = result["start_s"] + result["search_s"] + result["shutdown_s"]
    return result


def check_clean(side: str, grace_s: float) -> str:
    """After a side: wait up to ``grace_s`` for its processes to end; terminate any left."""
    strays, waited = leftover_processes(grace_s=grace_s)
    if not strays:
        return f"{side}: no leftover processes (clean after {waited:.1f}s)"
    lines = [f"{side}: WARNING, {len(strays)} leftover process(es) (now terminated):"]
    lines += [f"  pid {pid}: {cmd[:160]}" for pid, cmd in sorted(strays.items())]
    stop_strays(strays)
    return "\n".join(lines)


def print_machine(epochs: int) -> None:
    print("Machine")
    print(f"  cpu count : {os.cpu_count()}")
    print(f"  python    : {platform.python_version()} ({sys.executable})")
    print(f"  torch     : {version_of('torch')}")
    print(f"  ray       : {version_of('ray')}")
    print(f"  optuna    : {version_of('optuna')}")
    print(f"  sparktrain: {version_of('sparktrain')}")
    print(f"  platform  : {platform.platform()}")
    print(f"  load avg  : {load_average()} (1, 5, 15 min; other work on the machine skews timings)")
    print()
    print(
        f"Search: {NUM_TRIALS} trials (grid over lr {list(LRS)}), {N_PROCS} ranks per trial "
        f"(DDP, gloo, CPU), MLP 784-512-256-10, {epochs} epochs x {STEPS_PER_EPOCH} steps x "
        f"batch {BATCH_PER_RANK} per rank, no early stopping; {CONCURRENT_TRIALS} trial at a "
        f"time on both sides (Ray: num_cpus={RAY_NUM_CPUS}, max_concurrent_trials="
        f"{CONCURRENT_TRIALS}, Train V2: Tune function trainable -> TorchTrainer.fit())"
    )
    print(flush=True)


def print_table(sides: dict[str, dict[str, Any] | None], skipped: dict[str, str]) -> None:
    labels = {
        "sparktrain": "(a) sparktrain.tune, local backend",
        "ray": "(b) Ray Tune + TorchTrainer",
    }
    head = ["side", "import", "cluster start", f"search ({NUM_TRIALS} trials)", "shutdown",
            "start+search+shutdown", "child process wall", "best lr", "best loss"]  # fmt: skip
    print("Wall time (seconds)")
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for side, label in labels.items():
        res = sides.get(side)
        if res is None:
            cells = [label, *(["n/a"] * 6), f"skipped: {skipped.get(side, '')}", ""]
        else:
            loss = res["best_loss"]
            cells = [
                label, fmt(res["import_s"]), fmt(res["start_s"]) if side == "ray" else "-",
                fmt(res["search_s"]), fmt(res["shutdown_s"]) if side == "ray" else "-",
                fmt(res["total_s"]), fmt(res["wall_s"]), str(res["best_lr"]),
                "n/a" if loss is None else f"{loss:.5f}",
            ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print()


def print_trials(sides: dict[str, dict[str, Any] | None]) -> None:
    print("Final loss per trial")
    print()
    print("| lr | sparktrain | Ray |")
    print("|---:|---:|---:|")
    by_side = {
        side: {t["lr"]: t["loss"] for t in res["trials"]}
        for side, res in sides.items()
        if res is not None
    }
    for lr in LRS:
        cells = []
        for side in ("sparktrain", "ray"):
            value = by_side.get(side, {}).get(lr)
            cells.append("n/a" if value is None else f"{value:.5f}")
        print(f"| {lr} | {cells[0]} | {cells[1]} |")
    print()


def trial_seconds(side: dict[str, Any]) -> tuple[float | None, float | None]:
    """A side's first trial's duration and the median of the others (``None`` if unknown)."""
    seconds = [t["seconds"] for t in side["trials"] if t.get("seconds") is not None]
    if not seconds:
        return None, None
    return seconds[0], statistics.median(seconds[1:] or seconds)


def print_ratios(sides: dict[str, dict[str, Any] | None]) -> None:
    ours, ray = sides.get("sparktrain"), sides.get("ray")
    if ours is None or ray is None:
        print("Ratios: n/a (a side was skipped)")
        print()
        return
    search = ratio(ray["search_s"], ours["search_s"])
    total = ratio(ray["total_s"], ours["total_s"])
    wall = ratio(ray["wall_s"], ours["wall_s"])
    verdict = "n/a" if search is None else ("PASS" if search >= TARGET_RATIO else "MISS")
    print("Ratios Ray / sparktrain")
    print(f"  search only (Ray's cluster already up)   {fmt(search):>8}   "
          f"target >= {TARGET_RATIO} {verdict}")  # fmt: skip
    print(f"  cluster start + search + shutdown        {fmt(total):>8}")
    print(f"  child process wall (imports included)    {fmt(wall):>8}")
    per_trial = [fmt(s["search_s"] / NUM_TRIALS) for s in (ours, ray)]
    print(f"  search time per trial: sparktrain {per_trial[0]}s, Ray {per_trial[1]}s")
    first, later = trial_seconds(ours)
    print(f"  sparktrain trial durations: first (cold) {fmt(first)}s, later median {fmt(later)}s")
    _, ray_median = trial_seconds(ray)
    print(f"  Ray trial durations (Tune's time_total_s): median {fmt(ray_median)}s")
    same_lr = ours["best_lr"] == ray["best_lr"]
    diff = (
        abs(ours["best_loss"] - ray["best_loss"])
        if ours["best_loss"] is not None and ray["best_loss"] is not None
        else None
    )
    print(f"  best lr agrees: {'yes' if same_lr else 'NO'}; best loss differs by {fmt(diff)}")
    print(f"  Ray processes seen while its cluster ran (tagged): {ray.get('ray_processes')}")
    print(flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="epochs per trial")
    parser.add_argument("--skip-ray", action="store_true", help="do not run the Ray side")
    parser.add_argument("--child", choices=("sparktrain", "ray"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child == "sparktrain":
        child_sparktrain(args.epochs)
        return 0
    if args.child == "ray":
        child_ray(args.epochs)
        return 0
    os.environ[BENCH_TAG_VAR] = uuid.uuid4().hex
    started = time.perf_counter()
    print_machine(args.epochs)
    sides: dict[str, dict[str, Any] | None] = {"sparktrain": None, "ray": None}
    skipped: dict[str, str] = {}
    notes: list[str] = []
    log("(a) sparktrain.tune")
    sides["sparktrain"] = run_side("sparktrain", args.epochs)
    notes.append(check_clean("after sparktrain", grace_s=3.0))
    if args.skip_ray:
        skipped["ray"] = "--skip-ray"
    else:
        log("(b) Ray Tune + TorchTrainer")
        try:
            sides["ray"] = run_side("ray", args.epochs)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            skipped["ray"] = "failed; see the note above"
            print(f"NOTE: the Ray side failed:\n{exc}", flush=True)
        notes.append(check_clean("after Ray", grace_s=15.0))
    print_table(sides, skipped)
    print_trials(sides)
    print_ratios(sides)
    print("Leftover check")
    for note in notes:
        print(f"  {note}")
    print(f"Load average at the end: {load_average()}")
    print(f"Total benchmark time: {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
