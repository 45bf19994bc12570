"""Inside the ranks of ``TorchEstimator.fit``: the training loop, or the user's own.

Every rank gets the same :class:`FitJob` (the model, its loss and optimizer, and a
``sparktrain.data`` stream of the DataFrame that Spark wrote to the data cache) and reads its
own share of the rows. The built-in loop is the one a user would write: ``prepare_model`` for
the strategy, one optimizer step per batch, the epoch's mean loss over every rank reported to
the driver's progress bar, printed, and logged to MLflow when tracking is on. With
``trainFn``, the user's function gets a :class:`FitContext` and runs the loop instead.

Rank 0 returns a :class:`FitOutcome`: the trained model unwrapped to a plain module on the CPU
(gathered first for sharded strategies, on every rank), the spec of its output and of its
inputs (so that ``transform`` knows its result type without running anything), the loss per
epoch, and the MLflow model it logged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sparktrain.contract.env import contract_rank
from sparktrain.inference.rank import outputs
from sparktrain.spark.rank.fitjob import FitContext, FitJob, FitOutcome, features, float_dtype

#: Rows of the training data kept as the MLflow input example (the model's signature).
EXAMPLE_ROWS = 5


def _build(model: Any, seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)  # the same initial weights on every rank
    return model if isinstance(model, nn.Module) else model()


def _example(data: Any, inputs: Sequence[str]) -> dict[str, Any]:
    """The data's first rows, for the output spec and the MLflow signature."""
    from sparktrain.data import StreamingDataset

    first = StreamingDataset(
        data.source, batch_size=EXAMPLE_ROWS, columns=inputs, shuffle=False, rank=0, world_size=1
    )
    return next(iter(first))


def _plain(trained: Any) -> Any:
    """The trained model as a plain module on the CPU, a copy when it was on another device."""
    import copy

    from sparktrain import strategies
    from sparktrain.spark.rank.loop.lightning import StepModule

    plain = strategies.plain_module(trained)
    if isinstance(plain, StepModule):
        plain = plain.lightning
    if any(p.device.type != "cpu" for p in plain.parameters()):
        plain = copy.deepcopy(plain).cpu()
    return plain.eval()


def run_fit(job: FitJob) -> FitOutcome | None:
    """Train on this rank's share; rank 0 returns the outcome, the others ``None``."""
    import torch
    import torch.distributed as dist

    from sparktrain import strategies, tracking

    if not dist.is_initialized():
        dist.init_process_group(job.dist_backend)
    device = strategies.device()
    model = _build(job.model, job.seed)
    tracking.log_params(job.params)
    history: list[dict[str, float]] = []
    if job.train_fn is not None:
        context = FitContext(
            model, job.data, job.epochs, job.learning_rate, job.strategy, job.inputs,
            job.label, device, job.controls.val_data, job.controls.run_dir,
        )  # fmt: skip
        trained = job.train_fn(context)
        if trained is None:
            from sparktrain.ground.errors import ConfigError

            raise ConfigError("trainFn returned None; it must return the trained model.")
    else:
        from sparktrain.spark.rank.loop.epochs import train

        trained, history = train(job, model, device)
    plain = _plain(trained)
    example = _example(job.data, job.inputs)
    inputs = features(example, job.inputs, torch.device("cpu"), float_dtype(plain))
    with torch.inference_mode():
        output = plain(*inputs)
    spec = outputs.describe(output, len(inputs[0]))
    widths = tuple(None if t.dim() == 1 else int(t[0].numel()) for t in inputs)
    signature = {"input_example": inputs[0]} if len(inputs) == 1 else {}
    uri = tracking.log_model(plain, **signature)
    if contract_rank() != 0:
        return None
    return FitOutcome(plain, spec, widths, tuple(history), uri)
