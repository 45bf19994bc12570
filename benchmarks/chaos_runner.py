"""One run of ``chaos.py``: the launch of its workload with its fault struck meanwhile.

In this process (the caller's fork server, the Spark session and the warm state are reused
from run to run), the launch runs in a thread that must return within its timeout and a
margin; the caller-kill fault runs its caller as a subprocess (``chaos_caller.py``) instead,
SIGKILLs it at the moment and then looks for ranks that started after it was gone.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import chaos_procs as procs
import chaos_workloads as work
from chaos_checks import Outcome
from chaos_inject import Injector, continue_all, late_starts
from chaos_plan import Run

#: Each attempt's share of the call's ``timeout=`` (it stops a run that hangs): a run that may
#: start ``k`` attempts (its restarts, and for an elastic run one shrink) gets ``k`` of them, as
#: ``timeout=`` bounds the whole call; ``hang_timeout=`` of every run.
RUN_TIMEOUT = 30.0
HANG_TIMEOUT = 6.0
#: Seconds past the attempts' timeouts by which a launch must have returned (else: a hang).
MARGIN = 20.0
#: Seconds after a caller's SIGKILL before its late ranks are looked for (a fork server still
#: importing torch has finished by then: ``stress.py``'s kill row waits as long).
AFTER_CALLER_KILL = 3.0


class SoakAborted(Exception):
    """A launch hung and could not be unstuck: the soak cannot go on in this process."""


@dataclass(frozen=True)
class Context:
    """What every run shares: the soak's folder, the dataset, the checkpoint disk."""

    root: Path
    data_dir: str
    disk: procs.Disk
    ckpt_root: Path


def spec(
    workload: str, folder: Path, ckpt: Path, data_dir: str
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """The function, arguments and launch options of ``workload`` (``max_restarts`` apart)."""
    options: dict[str, Any] = {
        "num_processes": 2,
        "use_gpu": False,
        "timeout": RUN_TIMEOUT,
        "hang_timeout": HANG_TIMEOUT,
        "return_all": True,
        "log_ranks": (),
        "progress": False,
    }
    paths = (str(folder), str(ckpt))
    if workload == "stream":
        return work.stream, (data_dir, *paths, 0.1, 1), options
    if workload == "elastic":
        from sparktrain import LocalCluster

        options.update(backend=LocalCluster(nodes=2), min_processes=1)
        return work.stream, (data_dir, *paths, 0.15, 0), options
    if workload == "spark":
        options["backend"] = "spark"
    bodies = {"fsdp2": work.fsdp_mlp, "deepspeed": work.deepspeed_zero}
    return bodies.get(workload, work.ddp_mlp), paths, options


def _folders(run: Run, ctx: Context) -> tuple[Path, Path]:
    folder = ctx.root / f"run-{run.index:04d}"
    folder.mkdir()
    return folder, ctx.ckpt_root / f"run-{run.index:04d}"


def _call(
    fn: Callable[..., Any], args: tuple[Any, ...], options: dict[str, Any], box: dict[str, Any]
) -> None:
    from sparktrain import launch

    try:
        box["result"] = launch(fn, args, **options)
    except BaseException as error:
        box["error"] = error


def _unstick(injector: Injector) -> None:
    """After a hang: continue what was stopped and kill what the run left, so it can return."""
    continue_all(injector.stopped)
    procs.kill_all(list(procs.leftovers(0.0)))


def execute(run: Run, ctx: Context) -> Outcome:
    """Launch ``run``'s workload in this process while its fault strikes; the raw outcome."""
    folder, ckpt = _folders(run, ctx)
    fn, args, options = spec(run.workload, folder, ckpt, ctx.data_dir)
    options["max_restarts"] = run.max_restarts
    attempts = run.max_restarts + 1 + (1 if "min_processes" in options else 0)
    options["timeout"] = attempts * RUN_TIMEOUT
    started = time.monotonic()
    injector = Injector(run, folder, ctx.disk, started)
    injector.start()
    box: dict[str, Any] = {}
    thread = threading.Thread(target=_call, args=(fn, args, options, box), daemon=True)
    thread.start()
    thread.join(attempts * (RUN_TIMEOUT + HANG_TIMEOUT) + MARGIN)
    hung = thread.is_alive()
    if hung:
        _unstick(injector)
        thread.join(30.0)
        if thread.is_alive():
            raise SoakAborted(
                f"{run.describe()}: the launch did not return even after its ranks were killed"
            )
    seconds = time.monotonic() - started
    injector.finish()
    return Outcome(
        run,
        seconds=seconds,
        result=box.get("result"),
        error=box.get("error"),
        injected=injector.injected,
        hung=hung,
    )


def _caller_result(folder: Path, outcome: Outcome) -> None:
    """What a caller that was not killed in time wrote: its values, or its error's text."""
    path = folder / "result.json"
    if not path.exists():
        outcome.violations.append("the caller ended without a result (not killed)")
        return
    found = json.loads(path.read_text())
    if "error" in found:
        outcome.violations.append(
            f"the caller's run failed though no fault struck: {found['error']}"
        )
    else:
        values = {int(rank): value for rank, value in found["values"].items()}
        outcome.result = SimpleNamespace(return_values=values)


def execute_caller_kill(run: Run, ctx: Context) -> Outcome:
    """Run the workload from a caller subprocess and SIGKILL it at the run's moment."""
    folder, ckpt = _folders(run, ctx)
    script = Path(__file__).with_name("chaos_caller.py")
    command = [sys.executable, str(script), run.workload, str(folder), str(ckpt), ctx.data_dir]
    started = time.monotonic()
    with open(folder / "caller.log", "wb") as log:
        caller = subprocess.Popen(command, stdout=log, stderr=log)
    outcome = Outcome(run)
    try:
        caller.wait(timeout=run.moment)
    except subprocess.TimeoutExpired:
        caller.send_signal(signal.SIGKILL)
        killed_at = time.time()
        outcome.injected = f"SIGKILL to the caller (pid {caller.pid})"
    caller.wait()
    outcome.seconds = time.monotonic() - started
    if outcome.injected:
        time.sleep(AFTER_CALLER_KILL)
        late = late_starts(folder, killed_at)
        outcome.violations += [f"a rank started after the caller was killed: {x}" for x in late]
    else:
        _caller_result(folder, outcome)
    return outcome
