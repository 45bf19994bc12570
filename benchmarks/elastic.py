"""Elastic recovery benchmark: a node lost mid-epoch, sparktrain against torchrun's elastic agent.

Both sides run the same training loop (:func:`train`): DDP on an ``nn.Linear`` over gloo, one
epoch of a Parquet dataset of ids streamed with ``sparktrain.data.from_parquet``, a
``sparktrain.checkpoint`` every ``EVERY`` steps holding the model, the optimizer and the data
state, and ``checkpoint.load_latest`` at the start of every attempt. Each rank logs
``step, time.time(), world size, ids`` per step. Two nodes of one rank each; at step
``KILL_STEP`` (between two checkpoints) the second node is killed with SIGKILL, agent and rank
at once, and the run finishes on one rank. The data's exactly-once resumption is the same code
on both sides, so what differs is the recovery machinery:

* sparktrain: ``launch(train, ..., num_processes=2, min_processes=1, grow_back=False,
  backend=LocalCluster(nodes=2))``; ``cluster.kill_node(1)`` from ``on_report``;
* torchrun: two agents, ``python -m torch.distributed.run --nnodes=1:2 --nproc-per-node=1
  --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT --max-restarts=3`` running this file with
  ``--worker``, each agent in a session of its own; the first one started hosts the c10d store,
  the other one is killed (its process group and its worker's, which torchrun starts in a
  session of its own). torchrun's default rendezvous timeouts, printed with the table.

Measured from the per-rank step logs, for each side:

* recovery: from the kill to the first step completed on the smaller world (wall clock);
* work lost: steps done after the checkpoint the next attempt resumed from (done twice);
* duplicated and lost samples: the ids committed (each attempt counted up to the step the next
  one resumed from) against the dataset's.

Then the same loop kept in place (``launch(..., in_place=True)``, ``sparktrain.elastic.in_place``:
no checkpoint; the survivors keep their model, optimizer and data in memory): node 1 SIGKILLed
at the same step, and, as a preemption notice, ``sparktrain.preempt(1)`` there instead. Last,
the steady-state step of ``InPlace`` against DDP (``benchmarks/inplace_step.py``;
``--no-step-cost`` leaves it out).

Third, torchft on the same loop (``benchmarks/elastic_torchft.py``: two replica groups, the
second SIGKILLed at the same step, the lighthouse's heartbeat timeout at 1,000 ms and at its
default), in its own venv made on first use (``--no-torchft`` leaves it out).

    python benchmarks/elastic.py               # 3 runs a side, about 8 minutes on 2 cores
    python benchmarks/elastic.py --repeat 1    # one run a side

Every run has a wall-clock limit (``--limit``); whatever a run started is killed at its end, and
the leftover check looks for this benchmark's processes. ``--worker`` and ``--child`` are
internal: the script runs itself in those modes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import elastic_torchft
import inplace_step
from _common import (
    BENCH_TAG_VAR,
    fmt,
    free_port,
    kill_tree,
    leftover_processes,
    listening,
    log,
    print_machine,
    ratio,
    report_leftovers,
    stop_strays,
)

ROWS = 160  # the epoch: 20 steps on 2 ranks, or 5 steps on 2 then 30 on 1 after the kill
BATCH = 4
EVERY = 5  # steps between checkpoints
KILL_STEP = 8  # 3 steps after the checkpoint of step 5
STEP_SECONDS = 0.1
GROW_STEP_SECONDS = 0.4  # the grow side: the epoch outlasts a joiner's start (3-4 s here)
TARGET_RATIO = 3.0
IN_PLACE_RECOVERY_S = 0.5  # issue 32: kill -> next committed step, survivors kept in place


# --------------------------------------------------------------------------------------------
# The training loop, the same on both sides
# --------------------------------------------------------------------------------------------


def train(data_dir: str, ckpt_dir: str, log_dir: str, step_seconds: float) -> int:
    """One epoch of DDP on the ids, resumed from the latest checkpoint; returns the last step.

    Runs under sparktrain's launcher and under torchrun alike: rank, world size and the restart
    count come from the torch contract (``RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RESTART_COUNT``).
    """
    import torch
    import torch.distributed as dist
    from _common import resume
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sparktrain
    from sparktrain import checkpoint
    from sparktrain.data import from_parquet

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Linear(1, 1)
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = from_parquet(data_dir, batch_size=BATCH, seed=3)
    step = resume(ckpt_dir, net, optimizer, data)
    attempt = sparktrain.restart_count()
    path = Path(log_dir, f"attempt{attempt}-rank{rank}-{os.getpid()}.txt")
    with path.open("a") as out:
        out.write(f"resume {step}\n")
        out.flush()
        for batch in data:
            step += 1
            loss = (model(batch["x"][:, None]) ** 2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            ids = " ".join(str(int(i)) for i in batch["id"])
            out.write(f"{step} {time.time():.6f} {world} {ids}\n")
            out.flush()
            sparktrain.report(step=step, world=world)
            time.sleep(step_seconds)
            if step % EVERY == 0:
                state = {
                    "model": net.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "data": data.state_dict(),
                }
                checkpoint.save(state, ckpt_dir, step=step)
    dist.destroy_process_group()
    return step


def train_in_place(data_dir: str, log_dir: str, step_seconds: float) -> dict[str, int]:
    """The same loop kept in place (issue 32, branch): no checkpoint; the survivors go on."""
    import torch
    from torch import nn

    import sparktrain
    from sparktrain.data import from_parquet

    torch.manual_seed(0)
    net = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

    def make_data(rank: int, world: int) -> Any:
        return from_parquet(data_dir, batch_size=BATCH, seed=3, rank=rank, world_size=world)

    run = sparktrain.elastic.in_place(net, optimizer, make_data)
    path = Path(log_dir, f"attempt0-rank{run.me}-{os.getpid()}.txt")
    with path.open("a") as out:
        out.write("resume 0\n")
        for batch in run.batches():
            loss = (net(batch["x"][:, None]) ** 2).mean()
            loss.backward()
            world = run.world_size
            ids = " ".join(str(int(i)) for i in batch["id"])
            out.write(f"pending {run.steps + 1} {world} {ids}\n")  # a kill may come before
            out.flush()  # the line below: the step counts if a peer committed it at this size
            if run.step():
                out.write(f"{run.steps} {time.time():.6f} {world} {ids}\n")
                out.flush()
            sparktrain.report(step=run.steps, world=run.world_size)
            time.sleep(step_seconds)
    return {"steps": run.steps, "dropped": run.dropped}


def write_rows(folder: Path) -> str:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    ids = np.arange(ROWS, dtype=np.int64)
    table = pa.table({"id": ids, "x": np.random.default_rng(0).random(ROWS, dtype=np.float32)})
    pq.write_table(table, folder / "part-0.parquet", row_group_size=37)
    return str(folder)


# --------------------------------------------------------------------------------------------
# What the logs say
# --------------------------------------------------------------------------------------------


@dataclass
class Trial:
    """One run of one side: what the step logs say about the node's loss."""

    recovery_s: float | None = None
    work_lost: int | None = None
    duplicated: int | None = None
    missing: int | None = None
    attempts: int = 0
    resumed: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    extra: str = ""
    heal_s: float | None = None  # in place, grow: the node added -> the joiner's first step
    checkpoint_files: int | None = None


@dataclass
class Attempt:
    resumed: int = 0
    steps: list[tuple[int, float, int, list[int]]] = field(default_factory=list)
    #: In place: steps a rank reduced but did not log as committed (step, world, ids, log).
    unlogged: list[tuple[int, int, list[int], str]] = field(default_factory=list)
    by_log: dict[str, list[tuple[int, float, int, list[int]]]] = field(default_factory=dict)


def read_logs(log_dir: Path) -> dict[int, Attempt]:
    attempts: dict[int, Attempt] = {}
    for path in sorted(log_dir.glob("attempt*-rank*-*.txt")):
        number = int(path.name.split("-")[0].removeprefix("attempt"))
        attempt = attempts.setdefault(number, Attempt())
        mine = attempt.by_log.setdefault(path.name, [])
        pending: tuple[int, int, list[int], str] | None = None
        for line in path.read_text().splitlines():
            head, *rest = line.split()
            if head == "resume":
                attempt.resumed = int(rest[0])
            elif head == "pending":  # in place: the step about to be reduced
                if pending is not None:
                    attempt.unlogged.append(pending)
                pending = (int(rest[0]), int(rest[1]), [int(i) for i in rest[2:]], path.name)
            elif len(rest) >= 2:
                ids = [int(i) for i in rest[2:]]
                step = (int(head), float(rest[0]), int(rest[1]), ids)
                attempt.steps.append(step)
                mine.append(step)
                pending = None
        if pending is not None:
            attempt.unlogged.append(pending)
    return attempts


def analyse_in_place(log_dir: Path, killed_at: float | None, trial: Trial, dropped: int) -> Trial:
    """Fill ``trial`` for a run kept in place: one attempt; work lost is the steps dropped.

    A step counts where the survivor's weights have it: the survivor (the rank that logged
    steps on one rank) committed it. So a rank killed after its step was reduced, before it
    logged it, still has its rows counted, and one that logged a step the survivor dropped
    (its own reduction finished, the survivor's did not) has them counted as unread.
    """
    attempt = read_logs(log_dir).get(0, Attempt())
    survivors = [log for log, steps in attempt.by_log.items() if any(s[2] == 1 for s in steps)]
    kept = {(step, world) for log in survivors for step, _, world, _ in attempt.by_log[log]}
    ids = [i for step, _, world, batch in attempt.steps if (step, world) in kept for i in batch]
    ids += [i for step, world, batch, _ in attempt.unlogged if (step, world) in kept for i in batch]
    trial.attempts, trial.resumed, trial.work_lost = 1, [0], dropped
    trial.duplicated = len(ids) - len(set(ids))
    trial.missing = len(set(range(ROWS)) - set(ids))
    after = [t for _, t, world, _ in attempt.steps if world == 1 and killed_at and t > killed_at]
    if killed_at is None or not after:
        trial.problems.append("the node was never killed, or no step after it on one rank")
    else:
        trial.recovery_s = min(after) - killed_at
    return trial


def analyse(log_dir: Path, killed_at: float | None, trial: Trial) -> Trial:
    """Fill ``trial`` from the step logs of a run whose node was killed at ``killed_at``."""
    attempts = read_logs(log_dir)
    order = sorted(attempts)
    trial.attempts = len(order)
    trial.resumed = [attempts[a].resumed for a in order]
    if order != list(range(len(order))):
        trial.problems.append(f"attempts logged: {order}")
    ids: list[int] = []
    lost = 0
    for index, number in enumerate(order):
        attempt = attempts[number]
        upto = attempts[order[index + 1]].resumed if index + 1 < len(order) else None
        if upto is not None and attempt.steps:
            lost += max(s for s, _, _, _ in attempt.steps) - upto
        ids += [i for s, _, _, batch in attempt.steps if upto is None or s <= upto for i in batch]
    trial.duplicated = len(ids) - len(set(ids))
    trial.missing = len(set(range(ROWS)) - set(ids))
    if killed_at is None:
        trial.problems.append("the node was never killed")
        return trial
    if len(order) < 2:
        trial.problems.append("no attempt after the kill")
        return trial
    trial.work_lost = lost
    after = [t for a in order[1:] for _, t, world, _ in attempts[a].steps if world == 1]
    if after:
        trial.recovery_s = min(after) - killed_at
    else:
        trial.problems.append("no step on the smaller world")
    return trial


# --------------------------------------------------------------------------------------------
# sparktrain: a child process per run (so that the wall-clock limit holds whatever happens)
# --------------------------------------------------------------------------------------------


def child_sparktrain(work: Path, limit: float, mode: str = "restart") -> None:
    """Child mode: the elastic launch on a 2-node LocalCluster; writes ``work/result.json``.

    ``mode``: ``restart`` (the survivors restart from the checkpoint), ``kill`` (in place, node 1
    SIGKILLed), ``notice`` (in place, ``sparktrain.preempt(1)`` instead of the kill) or
    ``grow`` (in place, node 1 SIGKILLed and a node added back at once: a joiner heals from the
    survivor; ``GROW_STEP_SECONDS`` a step, so that the epoch outlasts the joiner's start).
    """
    in_place = mode != "restart"
    import sparktrain
    from sparktrain import LocalCluster, launch

    cluster = LocalCluster(nodes=2)
    killed: dict[str, Any] = {}

    def on_report(rank: int, record: dict[str, Any]) -> None:
        metrics = record.get("metrics") or {}
        step, world = record.get("step"), metrics.get("world")
        if rank == 0 and world == 2 and step is not None and step >= KILL_STEP and not killed:
            killed["at"] = time.time()
            killed["step"] = step
            if mode == "notice":
                killed["ranks"] = sparktrain.preempt(1)
            else:
                killed["pid"] = cluster.kill_node(1)
            if mode == "grow":
                cluster.add_node()
                killed["added"] = time.time()

    if in_place:
        function: Any = train_in_place
        step = GROW_STEP_SECONDS if mode == "grow" else STEP_SECONDS
        args: tuple[Any, ...] = (str(work / "data"), str(work / "logs"), step)
    else:
        function, args = train, (str(work / "data"), str(work / "ckpt"), str(work / "logs"),
                                 STEP_SECONDS)  # fmt: skip
    result = launch(
        function,
        args,
        num_processes=2,
        backend=cluster,
        min_processes=1,
        grow_back=mode == "grow",
        in_place=in_place,
        on_report=on_report,
        progress=False,
        log_ranks=[],
        timeout=limit,
    )
    rescales = [
        {
            "cause": r.cause,
            "detail": r.detail,
            "old": r.old_world_size,
            "new": r.new_world_size,
            "resumed_step": r.resumed_step,
            "resume_seconds": r.resume_seconds,
        }
        for r in result.rescales
    ]
    payload = {
        "killed": killed,
        "rescales": rescales,
        "attempts": result.attempts,
        "world_size": result.world_size,
        "value": result.value,
        "node_pids": cluster.node_pids(),
    }
    (work / "result.json").write_text(json.dumps(payload))
    sparktrain.shutdown_warm()


def run_sparktrain(work: Path, limit: float, mode: str = "restart") -> Trial:
    trial = Trial()
    in_place = mode != "restart"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(work)]
    command += ["--limit", str(limit), "--mode", mode]
    try:
        proc = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=limit + 30,
            check=False,
        )
    except subprocess.TimeoutExpired:
        trial.problems.append(f"the run passed its wall-clock limit ({limit + 30:.0f}s): a hang")
        return analyse(work / "logs", None, trial)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        trial.problems.append(f"the launch failed (exit {proc.returncode}):\n{tail}")
        return analyse(work / "logs", None, trial)
    result = json.loads((work / "result.json").read_text())
    killed = result["killed"]
    if in_place:
        analyse_in_place(work / "logs", killed.get("at"), trial, result["value"]["dropped"])
    else:
        analyse(work / "logs", killed.get("at"), trial)
    rescales = result["rescales"]
    seen = [(r["cause"], r["old"], r["new"], r["resumed_step"]) for r in rescales]
    cause = "preempted" if mode == "notice" else "lost"
    expected = [(cause, 2, 1, trial.resumed[1] if len(trial.resumed) > 1 else None)]
    if mode == "grow":
        expected.append(("grew", 1, 2, None))
        joiner = [t for log, steps in read_logs(work / "logs").get(0, Attempt()).by_log.items()
                  if "-rank2-" in log for _, t, _, _ in steps]  # fmt: skip
        ckpts = list((work / "logs").parent.glob("**/*.ckpt*"))
        if joiner and "added" in killed:
            trial.heal_s = min(joiner) - killed["added"]
        else:
            trial.problems.append("the joiner committed no step")
        trial.checkpoint_files = len(ckpts)
    if seen != expected:
        trial.problems.append(f"result.rescales {seen}, expected {expected}")
    if result["node_pids"]:
        trial.problems.append(f"node processes still running: {result['node_pids']}")
    if rescales and rescales[0]["resume_seconds"] is not None:
        trial.extra = f"Rescale.resume_seconds {rescales[0]['resume_seconds']:.2f}"
    return trial


# --------------------------------------------------------------------------------------------
# torchrun: two elastic agents on this machine
# --------------------------------------------------------------------------------------------


def start_agent(work: Path, name: str, port: int, rdzv_id: str) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={rdzv_id}",
        "--max-restarts=3",
        str(Path(__file__).resolve()),
        "--worker",
        str(work / "data"),
        str(work / "ckpt"),
        str(work / "logs"),
        str(STEP_SECONDS),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # torchrun sets it anyway, with a warning
    with open(work / f"{name}.out", "wb") as out:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def watch_and_kill(
    logs: Path, victim: subprocess.Popen[bytes], killed: dict[str, float], stop: threading.Event
) -> None:
    """Kill ``victim``'s node once a rank logged step ``KILL_STEP`` on two ranks."""
    while not stop.is_set():
        for path in logs.glob("attempt0-rank*-*.txt"):
            for line in path.read_text().splitlines():
                fields = line.split()
                if fields[0] == "resume" or len(fields) < 3:
                    continue
                if int(fields[0]) >= KILL_STEP and fields[2] == "2":
                    killed["at"] = time.time()
                    kill_tree(victim.pid)
                    return
        time.sleep(0.01)


def run_torchrun(work: Path, limit: float) -> Trial:
    trial = Trial()
    port, rdzv_id = free_port(), uuid.uuid4().hex[:12]
    deadline = time.monotonic() + limit
    host = start_agent(work, "agent0", port, rdzv_id)
    other: subprocess.Popen[bytes] | None = None
    killed: dict[str, float] = {}
    stop = threading.Event()
    try:
        while not listening(port):  # the first agent hosts the c10d store
            if host.poll() is not None or time.monotonic() > deadline:
                trial.problems.append("the first agent never opened the c10d store")
                return analyse(work / "logs", None, trial)
            time.sleep(0.05)
        other = start_agent(work, "agent1", port, rdzv_id)
        watcher = threading.Thread(
            target=watch_and_kill, args=(work / "logs", other, killed, stop), daemon=True
        )
        watcher.start()
        try:
            code = host.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            trial.problems.append(f"the run passed its wall-clock limit ({limit:.0f}s)")
        else:
            if code != 0:
                tail = (work / "agent0.out").read_text(errors="replace").strip().splitlines()
                trial.problems.append(f"agent 0 exited {code}:\n" + "\n".join(tail[-15:]))
    finally:
        stop.set()
        for agent in (other, host):
            if agent is not None:
                kill_tree(agent.pid)
                agent.wait()
    return analyse(work / "logs", killed.get("at"), trial)


def torchrun_defaults() -> str:
    """torchrun's rendezvous timeouts and agent intervals, as this torch has them."""
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    timeouts = dr.RendezvousTimeout._DEFAULT_TIMEOUTS
    params = inspect.signature(dr.DynamicRendezvousHandler.from_backend).parameters
    parsed = run.get_args_parser().parse_args(["script.py"])
    seconds = ", ".join(f"{k}={v.total_seconds():g}s" for k, v in timeouts.items())
    return (
        f"{seconds}, keep_alive_interval={params['keep_alive_interval'].default}s x "
        f"keep_alive_max_attempt={params['keep_alive_max_attempt'].default}, "
        f"monitor_interval={parsed.monitor_interval:g}s"
    )


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


#: Each side, and the mode of ``child_sparktrain`` it runs (``None``: torchrun).
SIDES = {
    "sparktrain": "restart",
    "sparktrain in place": "kill",
    "sparktrain in place, notice": "notice",
    "sparktrain in place, grow": "grow",
    "torchrun": None,
}


def median(trials: Sequence[Trial]) -> float | None:
    values = [t.recovery_s for t in trials if t.recovery_s is not None]
    return statistics.median(values) if values else None


def worst(values: Sequence[int | None]) -> str:
    if any(v is None for v in values):
        return "n/a"
    return str(max(v for v in values if v is not None))


def torchft_trial(found: dict[str, Any]) -> Trial:
    """A run of ``elastic_torchft.run_once`` as a row of the table."""
    return Trial(
        recovery_s=found["recovery_s"],
        work_lost=found["work_lost"],
        duplicated=found["duplicated"],
        missing=found["missing"],
        attempts=1,
        problems=list(found["problems"]),
        extra="one attempt: the survivor never restarts; no checkpoint is read",
    )


def print_table(results: dict[str, list[Trial]], repeat: int, limit: float) -> None:
    print(
        f"Elastic recovery, {time.strftime('%Y-%m-%d')}: 2 nodes x 1 rank (gloo), node 1 "
        f"SIGKILLed at step {KILL_STEP} (checkpoint every {EVERY} steps), {ROWS} rows of "
        f"{BATCH} a batch, {STEP_SECONDS:g}s a step; median of {repeat}, limit {limit:g}s a run"
    )
    print(f"  torchrun defaults: {torchrun_defaults()}")
    print()
    print("| side | recovery s | runs (s) | work lost (steps) | duplicated | lost samples |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for side, trials in results.items():
        runs = " ".join(fmt(t.recovery_s) for t in trials)
        lost = worst([t.work_lost for t in trials])
        dup = worst([t.duplicated for t in trials])
        missing = worst([t.missing for t in trials])
        print(f"| {side} | {fmt(median(trials))} | {runs} | {lost} | {dup} | {missing} |")
    if any(side.startswith("torchft") for side in results):
        print(
            "\n  torchft: each replica group reads its own shard; a lost group's unread rows "
            "are not handed to the survivor (its 'lost samples'). torchft-nightly 2026.10.26, "
            "lighthouse heartbeat timeout as named (5,000 ms is its default)."
        )
    print()
    print("Per run (attempts, the step each attempt resumed from)")
    for side, trials in results.items():
        for index, trial in enumerate(trials):
            line = f"  {side:<10} #{index + 1}: {trial.attempts} attempts, resumed {trial.resumed}"
            if trial.extra:
                line += f"; {trial.extra}"
            print(line)
            for problem in trial.problems:
                print(f"    PROBLEM: {problem}")
    print()
    value = ratio(median(results["torchrun"]), median(results["sparktrain"]))
    verdict = "n/a" if value is None else ("PASS" if value >= TARGET_RATIO else "MISS")
    exact = all(
        t.duplicated == 0 and t.missing == 0 and not t.problems
        for side in SIDES
        for t in results[side]
    )
    print("Targets")
    print(
        f"  {'torchrun / sparktrain recovery':<40} {fmt(value):>8}   "
        f"target >= {TARGET_RATIO:g}x  {verdict}"
    )
    print(f"  {'0 duplicated or lost (both sides)':<40} {'':>8}   {'PASS' if exact else 'MISS'}")
    # Issue 32's targets (in place: no restart, no checkpoint read), not met by restarting.
    recovery = median(results["sparktrain in place"])
    lost = [t.work_lost for t in results["sparktrain in place"]]
    fast = recovery is not None and recovery <= IN_PLACE_RECOVERY_S
    cheap = all(v is not None and v <= 1 for v in lost)
    print(
        f"  {'in place: recovery (issue 32)':<40} {fmt(recovery):>8}   "
        f"target <= {IN_PLACE_RECOVERY_S:g}s  {'PASS' if fast else 'MISS'}"
    )
    print(
        f"  {'in place: work lost (issue 32)':<40} {worst(lost):>8}   "
        f"target <= 1 step  {'PASS' if cheap else 'MISS'}"
    )
    grow = results["sparktrain in place, grow"]
    heals = [t.heal_s for t in grow if t.heal_s is not None]
    files = [t.checkpoint_files for t in grow]
    none_read = all(f == 0 for f in files) and len(heals) == len(grow)
    print(
        f"  {'in place, grow: checkpoint files (issue 32)':<40} {worst(files):>8}   "
        f"target 0 (healed from a live peer, {fmt(statistics.median(heals) if heals else None)} s "
        f"from the node's return to the joiner's first step)  {'PASS' if none_read else 'MISS'}"
    )
    notice = [t.work_lost for t in results["sparktrain in place, notice"]]
    free = all(v == 0 for v in notice)
    print(
        f"  {'in place, notice: work lost (issue 32)':<40} {worst(notice):>8}   "
        f"target 0 steps  {'PASS' if free else 'MISS'}"
    )
    print(flush=True)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=3, help="runs a side (default 3)")
    parser.add_argument(
        "--limit", type=float, default=120.0, help="wall-clock seconds a run (default 120)"
    )
    parser.add_argument(
        "--no-torchft", action="store_true", help="leave torchft's columns out (no venv made)"
    )
    parser.add_argument("--worker", nargs=4, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="restart", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-step-cost", action="store_true", help="leave the steady-state step cost out"
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        data_dir, ckpt_dir, log_dir, step_seconds = args.worker
        train(data_dir, ckpt_dir, log_dir, float(step_seconds))
        return 0
    if args.child:
        child_sparktrain(Path(args.child), args.limit, mode=args.mode)
        return 0
    os.environ[BENCH_TAG_VAR] = uuid.uuid4().hex
    started = time.perf_counter()
    print_machine("torch")
    results: dict[str, list[Trial]] = {side: [] for side in SIDES}
    torchft = None if args.no_torchft else elastic_torchft.setup()
    if torchft and "error" in torchft:
        log(f"torchft not measured: {torchft['error']}")
    elif torchft:
        results.update({f"torchft {ms} ms": [] for ms in elastic_torchft.HEARTBEATS_MS})
    with tempfile.TemporaryDirectory(prefix="sparktrain-elastic-") as tmp:
        data_dir = write_rows(Path(tmp, "data"))
        for index in range(args.repeat):
            for side, mode in SIDES.items():
                work = Path(tmp, f"{side}-{index}")
                (work / "logs").mkdir(parents=True)
                os.symlink(data_dir, work / "data")
                log(f"{side} run {index + 1} of {args.repeat}")
                if mode is None:
                    trial = run_torchrun(work, args.limit)
                else:
                    trial = run_sparktrain(work, args.limit, mode=mode)
                strays, _ = leftover_processes(5.0)
                if strays:
                    trial.problems.append(f"{len(strays)} process(es) left after the run")
                    stop_strays(strays)
                log(f"  recovery {fmt(trial.recovery_s)}s, work lost {trial.work_lost}")
                results[side].append(trial)
            for ms in elastic_torchft.HEARTBEATS_MS if torchft and "python" in torchft else ():
                log(f"torchft (heartbeat {ms} ms) run {index + 1} of {args.repeat}")
                work = Path(tmp, f"torchft{ms}-{index}")
                found = elastic_torchft.run_once(torchft["python"], data_dir, work, ms, args.limit)
                results[f"torchft {ms} ms"].append(torchft_trial(found))
    print_table(results, args.repeat, args.limit)
    if not args.no_step_cost:
        log("the steady-state step: DDP against in place")
        inplace_step.print_step_cost(inplace_step.measure(args.repeat * 2))
        print()
    report_leftovers()
    print(f"Total benchmark time: {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
