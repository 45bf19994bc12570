"""One epoch of training in the built-in loop: batches, losses, accumulation, train metrics.

The loss of a batch is the loss of each output against its label column (``labelCols``),
weighted by ``lossWeights``, each a mean over the rows weighted by ``weightCol`` when given. A
non-finite loss stops the fit, naming the rank, the epoch and the batch. Gradients are
accumulated over ``backwardPassesPerStep`` batches before each optimizer step; a per-step LR
schedule is stepped after it. With ``metrics``, the epoch's outputs and targets are kept for
the metrics computed over every rank at its end.
"""

from __future__ import annotations

from typing import Any

from sparktrain.spark.rank import tasks
from sparktrain.spark.rank.fitjob import FitJob, features, float_dtype
from sparktrain.spark.rank.loop import lightning, metrics
from sparktrain.spark.rank.loop import state as fitstate
from sparktrain.spark.rank.loop.state import Fit


def train_batches(job: FitJob) -> int:
    """Batches per epoch on each rank (``trainStepsPerEpoch`` bounds it)."""
    steps = job.controls.train_steps
    return min(len(job.data), steps) if steps else len(job.data)


def optimizer_steps(job: FitJob) -> int:
    """Optimizer steps per epoch on each rank (the last, short accumulation steps too)."""
    return -(-train_batches(job) // job.controls.accumulate)


def _targets(fit: Fit, batch: dict[str, Any], outputs: tuple[Any, ...]) -> list[Any]:
    job = fit.job
    return [
        tasks.labels(batch[name].to(fit.device), task, out, name)
        for name, task, out in zip(job.controls.labels, job.controls.tasks, outputs, strict=True)
    ]


def _outputs(fit: Fit, output: Any) -> tuple[Any, ...]:
    labels = fit.job.controls.labels
    outputs = tuple(output) if isinstance(output, (tuple, list)) else (output,)
    if len(outputs) != len(labels):
        from sparktrain.ground.errors import ConfigError

        raise ConfigError(
            f"the model returned {len(outputs)} output(s) and there are {len(labels)} label "
            f"column(s) ({', '.join(labels)}); give one label column per output (labelCols=)."
        )
    return outputs


def batch_loss(fit: Fit, batch: dict[str, Any], output: Any) -> tuple[Any, list[Any], list[Any]]:
    """The batch's loss (weighted over outputs and rows), its outputs and targets."""
    c = fit.job.controls
    outputs = _outputs(fit, output)
    targets = _targets(fit, batch, outputs)
    weight = batch[c.weight].to(fit.device) if c.weight else None
    total = 0
    for i, (out, target) in enumerate(zip(outputs, targets, strict=True)):
        value = tasks.weighted_loss(c.losses[i], out, target, weight)
        total = total + (c.loss_weights[i] if c.loss_weights else 1.0) * value
    return total, list(outputs), targets


def _check_loss(fit: Fit, loss: Any, epoch: int, index: int) -> None:
    """Refuse a missing loss (every rank must step together) and a non-finite one."""
    import torch

    if loss is None:
        from sparktrain.ground.errors import ConfigError

        raise ConfigError(
            f"training_step returned None at epoch {epoch}, batch {index}: in a distributed fit "
            "every rank must return a loss for every batch (its gradients are averaged over "
            "the ranks); return a zero loss instead of skipping."
        )
    if not bool(torch.isfinite(loss.detach())):
        from sparktrain.contract.env import contract_rank

        raise FloatingPointError(
            f"rank {contract_rank()}: the loss is {float(loss)} at epoch {epoch}, batch {index} "
            f"(step {fit.steps}); lower learningRate, clip gradients in a trainFn, or check the "
            "rows for NaN or infinite values."
        )


def forward_loss(fit: Fit, model: Any, batch: dict[str, Any]) -> tuple[Any, list[Any], list[Any]]:
    """``model``'s loss on the batch, its outputs and targets."""
    inputs = features(batch, fit.job.inputs, fit.device, float_dtype(model))
    return batch_loss(fit, batch, model(*inputs))


def _step_loss(fit: Fit, batch: dict[str, Any], index: int, kept: list[Any]) -> Any:
    """The batch's loss; with metrics, its outputs and targets are kept."""
    if fit.lightning:
        batch = lightning.on_device(batch, fit.device, float_dtype(fit.wrapped))
        return fit.wrapped(batch, index, lightning.TRAIN)
    loss, outputs, targets = forward_loss(fit, fit.wrapped, batch)
    if fit.job.controls.metrics:
        kept.append(([o.detach().cpu() for o in outputs], [t.detach().cpu() for t in targets]))
    return loss


def _optimizer_step(fit: Fit) -> None:
    fit.optimizer.step()
    fit.optimizer.zero_grad(set_to_none=True)
    fit.updates += 1
    if fit.schedule is not None:
        fit.schedule.after_step()


def train_epoch(fit: Fit, epoch: int, logged: lightning.Logged) -> dict[str, float]:
    """Train one epoch (from where a resume left it); its mean loss and train metrics."""
    import torch

    from sparktrain import strategies
    from sparktrain.rank.reporting import report

    job, c = fit.job, fit.job.controls
    fit.wrapped.train()
    carried_sum, carried_count, before = fit.partial  # before a resume (the sums: rank 0's)
    total, count, pending, kept = torch.zeros((), device=fit.device), 0, False, list[Any]()
    known = job.epochs * train_batches(job)
    for index, batch in enumerate(job.data, start=before):
        if c.train_steps and index >= c.train_steps:
            break
        logged.batch_rows = len(next(iter(batch.values())))
        loss = _step_loss(fit, batch, index, kept)
        _check_loss(fit, loss, epoch, index)
        strategies.backward(loss / c.accumulate, fit.optimizer)
        fit.steps, count, total, pending = fit.steps + 1, count + 1, total + loss.detach(), True
        if (before + count) % c.accumulate == 0:
            _optimizer_step(fit)
            pending = False
            if c.checkpoint_every and fit.updates % c.checkpoint_every == 0:
                sums = (carried_sum + float(total), carried_count + count)
                fitstate.save(fit, (*sums, before + count), in_epoch=True)
        report(step=fit.steps, total=known)
    if pending:  # the epoch's last batches, fewer than backwardPassesPerStep
        _optimizer_step(fit)
    fit.partial = (0.0, 0, 0)
    print(f"epoch {epoch} loss {float(total) / max(count, 1):.4f} ({before + count} batches)")
    mean = mean_over_ranks(total + carried_sum, count + carried_count)
    return {"loss": mean, **epoch_metrics(fit, kept, "")}


def mean_over_ranks(total: Any, batches: int) -> float:
    """The mean batch loss over every rank's batches (a collective)."""
    import torch
    import torch.distributed as dist

    summed = torch.stack([total.double().cpu(), torch.tensor(float(batches), dtype=torch.float64)])
    if dist.is_initialized():
        summed = summed.to(total.device)
        dist.all_reduce(summed)
    return float(summed[0] / summed[1].clamp(min=1))


def epoch_metrics(fit: Fit, kept: list[Any], prefix: str) -> dict[str, float]:
    """The metrics over every rank's kept outputs and targets (a collective)."""
    c = fit.job.controls
    if not c.metrics:
        return {}
    import torch

    count = len(c.labels)
    columns = [torch.cat([k[0][i].cpu() for k in kept]) if kept else torch.empty(0)
               for i in range(count)]  # fmt: skip
    columns += [torch.cat([k[1][i].cpu() for k in kept]) if kept else torch.empty(0)
                for i in range(count)]  # fmt: skip
    gathered = metrics.gather(columns)
    record: dict[str, float] = {}
    for i, name in enumerate(c.labels):
        where = prefix if count == 1 else f"{prefix}{name}_"
        record.update(metrics.compute(c.metrics, gathered[i], gathered[count + i], where))
    return record
