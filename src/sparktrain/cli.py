"""The ``sparktrain`` command: ``sparktrain run --nproc N train.py -- ARGS``.

Parses the command line into the same typed values the library takes and calls ``launch``; the
exit code is 0 on success, 1 when a rank failed (the error names it), 2 for bad input and 130
after Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sparktrain._version import __version__
from sparktrain.errors import ConfigError, TrainingFailedError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparktrain", description="Launch PyTorch distributed training."
    )
    parser.add_argument("--version", action="version", version=f"sparktrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run a training script on N processes (like torchrun)",
        description="Run SCRIPT on N ranks with the torch environment set; arguments after "
        "SCRIPT (or after --) go to the script.",
    )
    run.add_argument(
        "--nproc",
        "--nproc-per-node",
        type=int,
        default=1,
        dest="nproc",
        help="number of ranks (default: 1)",
    )
    device = run.add_mutually_exclusive_group()
    device.add_argument(
        "--gpu",
        dest="use_gpu",
        action="store_true",
        default=None,
        help="one GPU per rank (error without enough GPUs)",
    )
    device.add_argument(
        "--cpu",
        dest="use_gpu",
        action="store_false",
        help="run on CPU with gloo even if GPUs are present",
    )
    run.add_argument("--timeout", type=float, default=None, help="stop the run after SECONDS")
    run.add_argument(
        "--log-ranks",
        default=None,
        metavar="0,1",
        help="comma-separated ranks whose output is shown (default: all)",
    )
    run.add_argument("script", help="path of the Python script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _log_ranks(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--log-ranks={text!r} must be comma-separated ranks, e.g. 0,1") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    options = _parser().parse_args(argv)
    script_args = list(options.args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    from sparktrain.launcher import launch

    try:
        launch(
            options.script,
            script_args,
            num_processes=options.nproc,
            use_gpu=options.use_gpu,
            timeout=options.timeout,
            log_ranks=_log_ranks(options.log_ranks),
        )
    except ConfigError as exc:
        print(f"sparktrain: error: {exc}", file=sys.stderr)
        return 2
    except TrainingFailedError as exc:
        print(f"sparktrain: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sparktrain: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
