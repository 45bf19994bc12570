"""Checks of a Spark session, and whether a barrier stage of the launch's tasks can run.

Executors, task slots, GPU resource settings.

Design choices:
- The slot count and the task settings come from the Spark backend's own
  :func:`~sparktrain.backends.spark.session.cluster_facts`, and the barrier verdict from the
  launcher's :func:`~sparktrain.launchplan.layout.make_cluster_plan`, so doctor and a launch never
  disagree.
- Only a session that doctor started itself is given time for its executors to register (the
  launch's own wait); an existing session is judged as it is now, which keeps doctor fast.
- Spark Connect hides the scheduler: slots and executors are reported as unknown (warning).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparktrain.doctor.verdicts import Check, Finding
from sparktrain.ground.errors import ConfigError

if TYPE_CHECKING:
    from sparktrain.launchplan.layout import ClusterFacts

DISCOVERY_KEYS = (
    "spark.executor.resource.gpu.discoveryScript",
    "spark.worker.resource.gpu.discoveryScript",
    "spark.executor.resource.gpu.vendor",  # Kubernetes device plugins
)


def _conf(session: Any, key: str) -> str | None:
    value = session.conf.get(key, None)
    return None if value in (None, "") else str(value)


def _is_local(master: str) -> bool:
    """``local``/``local[N]``: the driver runs the tasks and no executor ever registers."""
    return master == "local" or master.startswith("local[")


def session_check(session: Any) -> Check:
    """Which session is examined: kind, Spark version, master."""
    from sparktrain.backends.spark.session import is_connect

    connect = is_connect(session)
    master = "(Spark Connect)" if connect else str(session.sparkContext.master)
    facts = {"connect": connect, "version": str(session.version), "master": master}
    kind = "Spark Connect" if connect else "classic"
    return Check(
        name="spark.session",
        verdict="ok",
        found=f"{kind} session, Spark {session.version}, master {master}",
        facts=facts,
    )


def executors_check(session: Any) -> Check:
    """The executors registered with the driver now."""
    from sparktrain.backends.spark.session import is_connect

    if is_connect(session):
        return Check(
            name="spark.executors",
            verdict="info",
            found="Spark Connect does not expose executors to a client",
        )
    sc = session.sparkContext
    master = str(sc.master)
    if _is_local(master):
        return Check(
            name="spark.executors",
            verdict="ok",
            found=f"local mode ({master}): the driver runs the tasks",
            facts={"executors": 0, "local": True},
        )
    count = int(sc._jsc.sc().getExecutorMemoryStatus().size()) - 1  # less the driver
    cores = _conf(session, "spark.executor.cores")
    facts = {"executors": count, "local": False, "executor_cores": cores}
    if count < 1:
        return Check(
            name="spark.executors",
            verdict="error",
            found="no executor is registered: no task can run",
            fix="start executors (check the cluster manager's UI and spark.executor.instances), "
            "or wait until they register",
            facts=facts,
        )
    each = f", {cores} cores each" if cores else ""
    return Check(
        name="spark.executors", verdict="ok", found=f"{count} executor(s){each}", facts=facts
    )


def gpu_settings_check(session: Any, *, use_gpu: bool | None = None) -> Check:
    """Spark's GPU scheduling settings: per task, per executor, and how executors find them."""
    task = _conf(session, "spark.task.resource.gpu.amount")
    executor = _conf(session, "spark.executor.resource.gpu.amount")
    discovery = {k: _conf(session, k) for k in DISCOVERY_KEYS}
    facts: dict[str, object] = {"task_amount": task, "executor_amount": executor, **discovery}
    try:
        amounts = (float(task or "0"), float(executor or "0"))
    except ValueError:
        finding = Finding(
            "error",
            f"spark.task.resource.gpu.amount={task!r} / "
            f"spark.executor.resource.gpu.amount={executor!r}: not numbers",
            "set both to whole numbers, e.g. 1 per task and the GPUs of one executor",
        )
    else:
        script = next((v for v in discovery.values() if v), None)
        finding = _gpu_finding(amounts, task, executor, script, use_gpu)
    return Check.judged("spark.gpu", finding, facts)


def _gpu_finding(
    amounts: tuple[float, float],
    task: str | None,
    executor: str | None,
    script: str | None,
    use_gpu: bool | None,
) -> Finding:
    """What the GPUs per task and per executor (``amounts``) mean for a launch."""
    task_gpus, executor_gpus = amounts
    if task_gpus == 0:
        if use_gpu:
            return Finding(
                "error",
                "GPUs asked for, but spark.task.resource.gpu.amount is unset: tasks get no GPU",
                "create the session with spark.task.resource.gpu.amount=1 and "
                "spark.executor.resource.gpu.amount=<GPUs per executor>, or use_gpu=False",
            )
        unused = f" (executors declare {executor} GPUs that tasks never get)" if executor else ""
        return Finding(
            "warning" if executor else "info",
            "no GPU scheduling: Spark ranks run on CPU, one per task" + unused,
            "for GPU ranks set spark.task.resource.gpu.amount=1" if executor else "",
        )
    if task_gpus != int(task_gpus):
        return Finding(
            "error",
            f"spark.task.resource.gpu.amount={task} shares a GPU between tasks; a rank needs a "
            "whole GPU",
            "set spark.task.resource.gpu.amount to a whole number such as 1",
        )
    found = f"{int(task_gpus)} GPU(s) per task, {executor or 'no'} per executor"
    if executor_gpus < task_gpus:
        return Finding(
            "error",
            found + ": a task asks for more GPUs than an executor has",
            f"set spark.executor.resource.gpu.amount to a multiple of {int(task_gpus)}",
        )
    if script is None:
        return Finding(
            "warning",
            found + ", but no GPU discovery script: executors may not find their GPUs",
            "set spark.executor.resource.gpu.discoveryScript (Spark ships "
            "examples/src/main/scripts/getGpusResources.sh), unless your platform sets it",
        )
    if executor_gpus % task_gpus:
        return Finding(
            "warning",
            found + f": {executor_gpus % task_gpus:g} GPU(s) per executor stay idle",
            f"make spark.executor.resource.gpu.amount a multiple of {int(task_gpus)}",
        )
    return Finding("ok", found + f", discovery {script}")


def slots_and_launch_checks(
    session: Any,
    processes: int | None,
    *,
    use_gpu: bool | None = None,
    wait: bool = False,
) -> list[Check]:
    """The concurrent task slots, and whether a barrier stage for ``processes`` ranks fits.

    Args:
        session: The Spark session examined.
        processes: The ranks of the intended launch, or ``None`` to only count slots.
        use_gpu: The launch's ``use_gpu`` (``None``: GPUs when tasks get them).
        wait: Give executors that are still registering the launch's time to appear.
    """
    from sparktrain.backends.spark.session import cluster_facts, is_connect
    from sparktrain.backends.spark.slots import SLOT_WAIT_SECONDS

    try:
        facts = cluster_facts(session, processes if wait and processes else 1)
    except ConfigError as exc:  # the GPU check names the bad setting already
        return [Check(name="spark.slots", verdict="error", found=str(exc), fix="see spark.gpu")]
    per_task = max(1, facts.task_gpus) if use_gpu is not False else 1
    data: dict[str, object] = {
        "slots": facts.slots,
        "task_cpus": facts.task_cpus,
        "task_gpus": facts.task_gpus,
    }
    if facts.slots is None:
        checks = [
            Check(
                name="spark.slots",
                verdict="warning",
                found="Spark Connect does not tell a client its task slots",
                fix="check the cluster has as many free task slots as barrier tasks; a barrier "
                "stage with too few fails after Spark's retries",
                facts=data,
            )
        ]
    else:
        ranks = facts.slots * per_task
        waited = f" (after waiting up to {SLOT_WAIT_SECONDS:g}s for executors)" if wait else ""
        checks = [
            Check(
                name="spark.slots",
                verdict="ok" if facts.slots else "error",
                found=f"{facts.slots} task slot(s) now{waited}: room for {ranks} rank(s)",
                fix="" if facts.slots else "add executors or cores; no task can run",
                facts={**data, "max_processes": ranks},
            )
        ]
    if processes is not None:
        local = not is_connect(session) and _is_local(str(session.sparkContext.master))
        checks.append(_barrier_check(processes, facts, per_task, use_gpu, local=local))
    return checks


def _barrier_check(
    processes: int, facts: ClusterFacts, per_task: int, use_gpu: bool | None, *, local: bool
) -> Check:
    from sparktrain.launchplan.layout import make_cluster_plan

    data: dict[str, object] = {"processes": processes, "slots": facts.slots}
    try:
        plan = make_cluster_plan(processes, facts=facts, use_gpu=use_gpu)
    except ConfigError as exc:
        tasks = -(-processes // per_task)
        if facts.slots is not None and tasks > facts.slots:
            more = (
                f"a master of local[{tasks}] or more"
                if local
                else "more executors (spark.executor.instances), more cores per executor "
                "(spark.executor.cores)"
                + (", or more GPUs per executor" if facts.task_gpus else "")
            )
            fix = (
                f"pass {facts.slots * per_task} processes or fewer (--processes "
                f"{facts.slots * per_task}), or give the cluster {tasks} task slots: {more}"
            )
        else:
            fix = "change the value the message names"
        data["tasks"] = tasks
        return Check(name="spark.barrier", verdict="error", found=str(exc), fix=fix, facts=data)
    data.update(tasks=plan.nodes, device=plan.device)
    return Check(
        name="spark.barrier",
        verdict="ok",
        found=f"a barrier stage of {plan.nodes} task(s) fits: {plan.describe()}",
        facts=data,
    )
