"""The ``sparktrain doctor`` subcommand: its options, and the call of :func:`run_checks`.

Exit codes: 0 when nothing blocks a launch (warnings allowed), 1 when a check has an error,
2 for bad options (as ``sparktrain run``).
"""

from __future__ import annotations

import argparse
import sys

from sparktrain.ground.errors import ConfigError


def add_doctor_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``doctor`` and its options to the ``sparktrain`` command."""
    doctor = commands.add_parser(
        "doctor",
        help="check this machine (and a Spark cluster) for what a launch needs",
        description="Check Python, torch, CUDA/NCCL, GPUs, gloo/NCCL, /dev/shm, ports, extras "
        "and Java; with --spark-master, the cluster's executors, task slots and GPU settings. "
        "Exit code 1 when something blocks a launch, 0 otherwise (warnings allowed).",
    )
    doctor.add_argument(
        "--processes",
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="the ranks you mean to launch: say whether N ranks (a barrier stage of their "
        "tasks on Spark) would be accepted",
    )
    device = doctor.add_mutually_exclusive_group()
    device.add_argument(
        "--gpu", dest="use_gpu", action="store_true", default=None, help="a launch with GPUs"
    )
    device.add_argument("--cpu", dest="use_gpu", action="store_false", help="a CPU launch")
    doctor.add_argument(
        "--spark-master",
        default=None,
        metavar="URL",
        help="start a Spark session on URL (spark://..., yarn, local-cluster[...], sc://...) "
        "and check it; it is stopped afterwards",
    )
    doctor.add_argument(
        "--spark-conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting for that session (repeatable), e.g. spark.task.resource.gpu.amount=1",
    )
    doctor.add_argument(
        "--probe",
        action="store_true",
        help="with a Spark session, run a real barrier stage of the launch's tasks and check "
        "the executors' Python (sparktrain, torch, version)",
    )
    doctor.add_argument(
        "--build-ops",
        nargs="*",
        default=None,
        metavar="OP",
        help="first build DeepSpeed's C++ ops here, into TORCH_EXTENSIONS_DIR (by default the "
        "ones a run loads at start, e.g. deepspeed_shm_comm on a CPU; or name them: cpu_adam "
        "fused_adam), removing build locks that no process holds; exit code 1 if one fails",
    )
    doctor.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="the run's checkpoint directory (a path or an s3://, gs://, abfs:// URL): check "
        "that this machine can write it, and with --probe every Spark task too",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")


def _conf(pairs: list[str]) -> dict[str, str]:
    conf = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"--spark-conf {pair!r} must be KEY=VALUE, e.g. spark.executor.cores=4"
            )
        conf[key.strip()] = value
    return conf


def run_doctor(options: argparse.Namespace) -> int:
    """Run the checks the options ask for, print them; returns the exit code."""
    from sparktrain.doctor.api import run_checks
    from sparktrain.doctor.verdicts import render_json, render_report

    failed_ops = False
    try:
        if options.build_ops is not None:
            failed_ops = _build_ops(options.build_ops)
        report = run_checks(
            processes=options.processes,
            use_gpu=options.use_gpu,
            spark_master=options.spark_master,
            spark_conf=_conf(options.spark_conf),
            probe=options.probe,
            checkpoint_dir=options.checkpoint_dir,
        )
    except ConfigError as exc:
        print(f"sparktrain: error: {exc}", file=sys.stderr)
        return 2
    print(render_json(report) if options.json else render_report(report))
    return max(report.exit_code, int(failed_ops))


def _build_ops(names: list[str]) -> bool:
    """Build the ops, one line each on stderr; whether one failed."""
    from sparktrain.doctor.ops import build_ops

    built = build_ops(names)
    for op in built:
        if op.error:
            print(f"sparktrain: could not build {op.name}: {op.error}", file=sys.stderr)
        else:
            where = f" (kept in {op.folder})" if op.folder else " (installed with DeepSpeed)"
            print(f"sparktrain: {op.name} ready in {op.seconds:.1f}s{where}", file=sys.stderr)
    return any(op.error for op in built)
