"""The built-in loop of ``TorchEstimator.fit``, run by every rank.

Per epoch: the training rows (gradient accumulation over ``backwardPassesPerStep`` batches, the
LR schedule stepped, a non-finite loss stopping the fit with its rank, epoch and step named),
then the validation rows (each read once over all the ranks), then one record of the epoch's
means and metrics over every rank: into ``history``, printed, shown on the progress bar and
logged to MLflow. Early stopping and the callbacks decide together whether the fit goes on,
and the fit checkpoints (``state``) at each epoch's end and every ``checkpointEvery`` steps.
A fit started again (``max_restarts``, an elastic resize, a new ``fit`` with the same
``runId``) resumes from its newest checkpoint with its history.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from sparktrain.spark.rank import tasks
from sparktrain.spark.rank.fitjob import FitJob, float_dtype
from sparktrain.spark.rank.loop import controls, lightning, steps
from sparktrain.spark.rank.loop import state as fitstate
from sparktrain.spark.rank.loop.state import Fit


def _prepare(job: FitJob, model: Any, device: Any) -> Fit:
    from sparktrain import strategies
    from sparktrain.strategies.memory import torch_optimizer  # LR schedulers take torch's

    c = job.controls
    is_lightning = lightning.is_lightning(model)
    if is_lightning:
        model.to(device)  # so that the module's own device and dtype (self.device) follow
    wrapped = strategies.prepare_model(lightning.StepModule(model) if is_lightning else model,
                                       job.strategy)  # fmt: skip
    if is_lightning:
        optimizer, made = lightning.optimizers(model)
        optimizer = strategies.prepare_optimizer(optimizer, wrapped)
        schedule = controls.wrap_scheduler(made)
    else:
        optimizer = tasks.make_optimizer(job.optimizer, wrapped.parameters(), job.learning_rate)
        optimizer = strategies.prepare_optimizer(optimizer, wrapped)
        schedule = None
    metric = controls.monitored(c.monitor, c.val_data is not None)
    mode = controls.mode_of(metric, c.mode)
    if schedule is None:
        schedule = controls.make_schedule(
            c.schedule, torch_optimizer(optimizer), total_steps=job.epochs *
            steps.optimizer_steps(job), epochs=job.epochs, mode=mode,
        )  # fmt: skip
    stopper = None
    if c.patience > 0:
        stopper = controls.EarlyStopping(metric, mode, c.patience, c.min_delta)
    return Fit(job, wrapped, optimizer, device, schedule, stopper, is_lightning)


def _validate(fit: Fit, logged: lightning.Logged) -> dict[str, float]:
    """The loss and metrics over the validation rows, each row read by one rank."""
    import torch
    import torch.distributed as dist

    c = fit.job.controls
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    lockstep = not fitstate.checkpointable(fit.wrapped)  # sharded: every rank runs every batch
    model = fit.wrapped if lockstep else getattr(fit.wrapped, "module", fit.wrapped)
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    kept: list[Any] = []
    limit = c.val_steps * world if c.val_steps else None
    with torch.no_grad():
        for index, batch in enumerate(c.val_data):
            if limit is not None and index >= limit:
                break
            mine = index % world == rank
            if not (mine or lockstep):
                continue
            logged.batch_rows = len(next(iter(batch.values())))
            if fit.lightning:  # sharded: every rank runs the step, only the batch's own logs it
                logged.muted = not mine
                moved = lightning.on_device(batch, fit.device, float_dtype(model))
                model(moved, index, lightning.VALIDATE)
                logged.muted = False
                continue
            loss, outputs, targets = steps.forward_loss(fit, model, batch)
            if mine:
                mass = _mass(batch, c.weight)
                sums += torch.tensor([float(loss) * mass, mass], dtype=torch.float64)
                if c.metrics:
                    kept.append(([o.cpu() for o in outputs], [t.cpu() for t in targets]))
    if fit.lightning:
        return {}
    if dist.is_initialized():
        sums = sums.to(fit.device)  # NCCL reduces only tensors on the rank's GPU
        dist.all_reduce(sums)
    rows = float(sums[1])
    record = {"val_loss": float(sums[0] / rows) if rows > 0 else float("nan")}
    return {**record, **steps.epoch_metrics(fit, kept, "val_")}


def _mass(batch: dict[str, Any], weight: str | None) -> float:
    """What a batch's mean loss is averaged over: its rows, or the sum of its weights."""
    if weight:
        return float(batch[weight].double().sum())
    return float(len(next(iter(batch.values()))))


def _agreed(stop: bool, device: Any) -> bool:
    """Whether any rank asked to stop (so that every rank stops at the same epoch)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return stop
    flag = torch.tensor([1.0 if stop else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _end_epoch(fit: Fit, epoch: int, record: dict[str, float]) -> bool:
    """Record the epoch everywhere, then decide (every rank alike) whether the fit stops."""
    from sparktrain import tracking
    from sparktrain.rank.reporting import report

    c = fit.job.controls
    fit.history.append({"epoch": float(epoch), **record})
    report(step=fit.steps, total=fit.job.epochs * steps.train_batches(fit.job), epoch=epoch,
           **record)  # fmt: skip
    tracking.log_metrics(record, step=epoch)
    shown = " ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "loss")
    if shown:
        print(f"epoch {epoch} {shown}")
    metric = controls.monitored(c.monitor, c.val_data is not None)
    if fit.schedule is not None:
        fit.schedule.after_epoch(record, metric)
    stop = False
    if fit.stopper is not None:
        stop = fit.stopper.update(epoch, record, fit.wrapped.state_dict)
    for callback in c.callbacks:
        stop = bool(callback(epoch, dict(record))) or stop
    fit.stopped = _agreed(stop, fit.device)
    fit.epoch = epoch + 1
    fitstate.save(fit)
    if fit.stopped:
        print(f"stopped after epoch {epoch}: {_why(fit)}")
    return fit.stopped


def _why(fit: Fit) -> str:
    stopper = fit.stopper
    if stopper is not None and stopper.waited >= stopper.patience > 0:
        return (f"{stopper.metric} has not improved for {stopper.waited} epoch(s); the best "
                f"was {stopper.best:.4f} at epoch {stopper.best_epoch}")  # fmt: skip
    return "a callback asked to stop"


def train(job: FitJob, model: Any, device: Any) -> tuple[Any, list[dict[str, float]]]:
    """Run the fit (resuming from the run folder's checkpoint); the trained, wrapped model."""
    fit = _prepare(job, model, device)
    fitstate.resume(fit)
    while fit.epoch < job.epochs and not fit.stopped:
        epoch, logged = fit.epoch, lightning.Logged()
        job.data.set_epoch(epoch)
        with lightning.logging_into(model, logged) if fit.lightning else nullcontext():
            record = steps.train_epoch(fit, epoch, logged)
            if job.controls.val_data is not None:
                record.update(_validate(fit, logged))
            if fit.lightning:
                record.update(logged.means())
        _end_epoch(fit, epoch, record)
    stopper = fit.stopper
    if stopper is not None and job.controls.restore_best and stopper.best_state is not None:
        fit.wrapped.load_state_dict(stopper.best_state)
        print(f"restored the weights of epoch {stopper.best_epoch} "
              f"({stopper.metric} {stopper.best:.4f})")  # fmt: skip
    return fit.wrapped, fit.history
