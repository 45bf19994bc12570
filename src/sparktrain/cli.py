"""The ``sparktrain`` command: ``sparktrain run --nproc N train.py -- ARGS``, ``sparktrain plan``.

Parses the command line into the same typed values the library takes and calls ``launch`` (or
the memory planner); the exit code is 0 on success, 1 when a rank failed (the error names it), 2
for bad input and 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sparktrain.ground.errors import ConfigError, TrainingFailedError
from sparktrain.ground.version import __version__

if TYPE_CHECKING:
    from sparktrain.planner import Activations, MemoryPlan


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
    _add_option_flags(run)
    run.add_argument("script", help="path of the Python script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    _add_plan_parser(commands)
    from sparktrain.doctor.command import add_doctor_parser

    add_doctor_parser(commands)
    return parser


def _add_option_flags(run: argparse.ArgumentParser) -> None:
    """One flag per run option (``--hang-timeout``, ``--mlflow/--no-mlflow``, ...).

    The flags come from :class:`~sparktrain.launchplan.options.RunOptions` itself; left out are
    ``return_all`` (a script returns no value) and ``on_report`` (a function).
    """
    from sparktrain.launchplan.option_docs import cli_options

    group = run.add_argument_group("run options (as for sparktrain.launch)")
    for name, parse, text in cli_options():
        flag = "--" + name.replace("_", "-")
        if parse is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            group.add_argument(flag, type=_parser_of(flag, parse), default=None, help=text)


def _parser_of(flag: str, parse: Any) -> Any:
    def read(text: str) -> Any:
        try:
            return parse(text)
        except (ValueError, ConfigError) as exc:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: {exc}") from None

    read.__name__ = getattr(parse, "__name__", "value")
    return read


def _given_options(parsed: argparse.Namespace) -> dict[str, Any]:
    from sparktrain.launchplan.option_docs import cli_options

    return {
        name: getattr(parsed, name)
        for name, _, _ in cli_options()
        if getattr(parsed, name) is not None
    }


def _add_plan_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from sparktrain.planner.bytemodel import OPTIMIZERS, PRECISIONS

    plan = commands.add_parser(
        "plan",
        help="memory per GPU of DDP / ZeRO-1/2/3 / offload, and the strategy to use",
        description="Estimate the memory per GPU of each data-parallel strategy for a model "
        "and cluster (ZeRO paper formulas), and recommend one.",
    )
    model = plan.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", metavar="COUNT", help="parameter count, e.g. 13B or 350M")
    model.add_argument(
        "--hf-config", metavar="CONFIG_JSON", help="a Hugging Face config.json of the model"
    )
    plan.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node")
    plan.add_argument("--nodes", type=int, default=1, help="number of nodes (default: 1)")
    plan.add_argument("--gpu-memory", default=None, metavar="SIZE", help="one GPU's memory: 80GB")
    plan.add_argument(
        "--cpu-memory", default=None, metavar="SIZE", help="one node's CPU memory, for offload"
    )
    plan.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed")
    plan.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    plan.add_argument(
        "--headroom", type=float, default=0.2, help="fraction of memory kept free (default 0.2)"
    )
    acts = plan.add_argument_group(
        "activations (all optional; --seq-len and --batch-size go together)"
    )
    acts.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    acts.add_argument("--batch-size", type=int, default=None, help="micro-batch per GPU")
    acts.add_argument("--hidden-size", type=int, default=None, help="the model's hidden size")
    acts.add_argument("--layers", type=int, default=None, help="the model's layer count")
    acts.add_argument("--heads", type=int, default=None, help="attention heads")
    acts.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (logits)")
    acts.add_argument("--checkpointing", action="store_true", help="full activation checkpointing")
    acts.add_argument(
        "--microbatches", type=int, default=None, help="micro-batches per pipeline step (4*pp)"
    )
    acts.add_argument(
        "--tied-embeddings", action="store_true", help="the output head shares the embedding"
    )
    acts.add_argument(
        "--attention-scores",
        action="store_true",
        help="attention stores the s x s scores (eager attention, not FlashAttention/SDPA)",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.add_argument(
        "--advise-cluster",
        action="store_true",
        help="also advise the GPU kind and single node vs multi-node",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit code."""
    options = _parser().parse_args(argv)
    if options.command == "doctor":
        from sparktrain.doctor.command import run_doctor

        return run_doctor(options)
    if options.command == "plan":
        try:
            print(_plan(options))
        except ConfigError as exc:
            print(f"sparktrain: error: {exc}", file=sys.stderr)
            return 2
        return 0
    script_args = list(options.args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    from sparktrain.driver.launch import launch

    try:
        launch(
            options.script,
            script_args,
            num_processes=options.nproc,
            use_gpu=options.use_gpu,
            **_given_options(options),
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


def _plan(options: argparse.Namespace) -> str:
    """Run the planner on the parsed options; the text (or JSON) to print."""
    import json

    from sparktrain.planner import advise_cluster
    from sparktrain.planner.units import parse_count

    model: object = None
    if options.params is not None:
        model = parse_count(options.params, name="--params")
    else:
        model = _read_config(options.hf_config)
    activation = _activation(options)
    shown: list[str] = []
    data: dict[str, object] = {}
    if options.gpus_per_node is not None or options.gpu_memory is not None:
        result = _memory_plan(options, model, activation)
        shown.append(str(result))
        data.update(result.to_dict())
    elif not options.advise_cluster:
        raise ConfigError(
            "a plan needs the cluster: pass --gpus-per-node N and --gpu-memory SIZE (e.g. 80GB), "
            "or --advise-cluster to be told which GPUs and how many."
        )
    if options.advise_cluster:
        from sparktrain.planner.cluster import advice_to_dict

        advice = advise_cluster(
            model,
            precision=options.precision,
            optimizer=options.optimizer,
            activation=activation,
            headroom=options.headroom,
            gpus_per_node=options.gpus_per_node or 8,
        )
        shown.append(str(advice))
        data["cluster_advice"] = advice_to_dict(advice)
    return json.dumps(data, indent=2) if options.json else "\n\n".join(shown)


def _activation(options: argparse.Namespace) -> Activations | None:
    """The ``Activations`` of ``--seq-len`` and ``--batch-size`` (and the shape), or ``None``."""
    from sparktrain.planner import Activations

    if (options.seq_len is None) != (options.batch_size is None):
        raise ConfigError(
            f"--seq-len={options.seq_len} --batch-size={options.batch_size}: activations need "
            "both; pass both, or neither to leave activations out."
        )
    if options.seq_len is None:
        return None
    return Activations(
        seq_len=options.seq_len,
        batch_size=options.batch_size,
        hidden_size=options.hidden_size,
        num_layers=options.layers,
        num_heads=options.heads,
        vocab_size=options.vocab_size,
        checkpointing=options.checkpointing,
        attention_scores=options.attention_scores,
    )


def _memory_plan(
    options: argparse.Namespace, model: object, activation: Activations | None
) -> MemoryPlan:
    """The ``MemoryPlan`` of ``--gpus-per-node`` and ``--gpu-memory`` (both needed)."""
    from sparktrain.planner import plan
    from sparktrain.planner.units import parse_bytes

    if options.gpus_per_node is None or options.gpu_memory is None:
        raise ConfigError(
            f"--gpus-per-node={options.gpus_per_node} --gpu-memory={options.gpu_memory}: a "
            "plan needs both, e.g. --gpus-per-node 4 --gpu-memory 80GB."
        )
    cpu_memory = options.cpu_memory
    return plan(
        model,
        gpus_per_node=options.gpus_per_node,
        nodes=options.nodes,
        gpu_memory=parse_bytes(options.gpu_memory, name="--gpu-memory"),
        precision=options.precision,
        optimizer=options.optimizer,
        cpu_memory=None if cpu_memory is None else parse_bytes(cpu_memory, name="--cpu-memory"),
        activation=activation,
        headroom=options.headroom,
        microbatches=options.microbatches,
        tied_embeddings=options.tied_embeddings,
    )


def _read_config(path: str) -> dict[str, object]:
    import json

    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--hf-config={path!r} could not be read as JSON ({exc}); pass the path of a "
            "Hugging Face config.json."
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"--hf-config={path!r} holds no JSON object; pass a config.json.")
    return config


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
