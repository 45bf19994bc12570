"""``hvd.DistributedOptimizer``: the wrapped optimizer averages gradients over ranks in ``step``.

Horovod wraps the optimizer in a subclass of its own class whose gradient hooks start one
allreduce per parameter as soon as its gradient is ready; its coordinator matches them across
ranks by name. ``torch.distributed`` has no such matching, so here the hooks only count backward
passes (for ``backward_passes_per_step`` and Horovod's errors), and ``synchronize()`` (called
by ``step()``) reduces every gradient at once, one flat buffer per device and dtype, in
parameter order: the same order on every rank, few collectives, the same numbers.

The optimizer object is converted in place (its class becomes a subclass of its own class), so
its state, hyperparameters and LR schedulers attached to it carry over, and ``isinstance`` checks
still hold. Horovod returns a new optimizer built from ``param_groups`` instead.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sparktrain.ground.errors import ConfigError
from sparktrain.horovod.torch import adasum
from sparktrain.horovod.torch.collectives import ReduceOp, check_op, require_init
from sparktrain.horovod.torch.compression import Compression, Compressor

_TOO_MANY = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)


@dataclass
class _Settings:
    compression: type[Compressor]
    passes: int
    op: ReduceOp
    predivide: float
    sparse_as_dense: bool
    counts: dict[torch.Tensor, int] = field(default_factory=dict)
    hooks: list[Any] = field(default_factory=list)
    synchronized: bool = False
    should_synchronize: bool = True


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the user's optimizer class by :func:`DistributedOptimizer`."""

    _hvd: _Settings

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def synchronize(self) -> None:
        """Reduce every gradient over the ranks now (``step()`` calls this)."""
        settings = self._hvd
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in self._params():
            if p.grad is None:  # another rank may have a gradient for it
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                if not settings.sparse_as_dense:
                    raise ConfigError(
                        "a parameter has a sparse gradient; pass sparse_as_dense=True to "
                        "DistributedOptimizer to reduce it as a dense tensor."
                    )
                p.grad = p.grad.to_dense()
            buckets.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for grads in buckets.values():
            _reduce_flat(grads, settings)
        settings.counts.clear()
        settings.synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Let ``step()`` use gradients already reduced by an explicit ``synchronize()``."""
        self._hvd.should_synchronize = False
        try:
            yield
        finally:
            self._hvd.should_synchronize = True

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Reduce the gradients over the ranks (unless skipped), then take the step."""
        settings = self._hvd
        if settings.op is ReduceOp.ADASUM:
            return self._adasum_step(closure)
        if settings.should_synchronize:
            if settings.synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(): the gradients are reduced twice.",
                    stacklevel=2,
                )
            self.synchronize()
        settings.synchronized = False
        return super().step(closure)

    def _adasum_step(self, closure: Callable[[], float] | None) -> Any:
        """Horovod's Adasum optimizer: the local step, then the updates combined.

        Each parameter's update (not its gradient, as Horovod does) is combined over the ranks
        with Adasum.
        """
        params = self._params()
        before = [p.detach().clone() for p in params]
        result = super().step(closure)
        with torch.no_grad():
            for p, start in zip(params, before, strict=True):
                p.copy_(start + adasum.allreduce(p - start))
        self._hvd.counts.clear()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients; an error between ``backward()`` and ``step()``, as in Horovod."""
        if self._hvd.counts:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition."
            )
        super().zero_grad(set_to_none)


def _reduce_flat(grads: list[torch.Tensor], settings: _Settings) -> None:
    """Reduce ``grads`` (same device and dtype) in one collective and write them back."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    sent, ctx = settings.compression.compress(flat)
    sent = sent.clone() if sent is flat else sent
    average = settings.op is ReduceOp.AVERAGE
    if average and settings.predivide != 1.0:
        sent.div_(settings.predivide)
    op = dist.ReduceOp.SUM if average or settings.op is ReduceOp.SUM else None
    if op is None:
        raise ConfigError(f"op={settings.op.name} cannot reduce gradients; pass Average or Sum")
    dist.all_reduce(sent, op=op)
    out = settings.compression.decompress(sent, ctx)
    if average:
        out.mul_(settings.predivide / dist.get_world_size())
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(out[offset : offset + n].view_as(g))
        offset += n


_CLASSES: dict[type, type] = {}


def _distributed_class(base: type) -> type:
    if issubclass(base, _DistributedOptimizer):
        raise ConfigError("this optimizer is already a DistributedOptimizer; wrap it once.")
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (_DistributedOptimizer, base), {})
    return _CLASSES[base]


def _check_names(optimizer: torch.optim.Optimizer, named_parameters: Iterable[Any]) -> None:
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ConfigError(
            "named_parameters should be a sequence of tuples (name, parameter), usually "
            "produced by model.named_parameters()."
        )
    names = [name for name, _ in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(
            "Parameter names in named_parameters must be unique. Found duplicates: "
            + ", ".join(duplicates)
        )
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if ids - {id(p) for _, p in named}:
        raise ConfigError(
            "named_parameters was specified, but one or more model parameters were not named; "
            "pass model.named_parameters() of the model whose parameters the optimizer holds."
        )


def DistributedOptimizer(  # noqa: PLR0917 - Horovod's name and positional signature
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: object = ReduceOp.AVERAGE,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: object = None,
    sparse_as_dense: bool = False,
    process_set: object = None,
) -> torch.optim.Optimizer:
    """Make ``optimizer`` reduce gradients over every rank before each step (Horovod's API).

    Args:
        optimizer: A ``torch.optim.Optimizer``; converted in place and returned.
        named_parameters: ``model.named_parameters()``; checked like Horovod does.
        compression: ``Compression.none`` or ``Compression.fp16`` (gradients sent as float16).
        backward_passes_per_step: Backward passes accumulated locally before each ``step()``.
        op: ``hvd.Average`` (default), ``hvd.Sum``, or ``hvd.Adasum`` (each step's update,
            not the gradient, is combined over the ranks with Adasum, as Horovod does).
        gradient_predivide_factor: With Average, divide by this before the sum and by
            ``size / factor`` after.
        num_groups: Accepted for compatibility (all gradients travel as one buffer).
        groups: Accepted for compatibility (all gradients travel as one buffer).
        sparse_as_dense: Reduce sparse gradients as dense tensors.
        process_set: Only the global set (``None``) is supported.

    Returns:
        The same optimizer object, now distributed.

    Raises:
        ConfigError: A bad argument, or a parameter missing from ``named_parameters``.
    """
    require_init()
    reduce_op = check_op(op)
    if reduce_op not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
        raise ConfigError(
            f"op={reduce_op.name} cannot reduce gradients; pass Average, Sum or Adasum."
        )
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
        raise ConfigError(f"backward_passes_per_step={backward_passes_per_step!r} must be an int")
    if backward_passes_per_step < 1:
        raise ConfigError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
    if gradient_predivide_factor != 1.0 and reduce_op is not ReduceOp.AVERAGE:
        raise ConfigError("gradient_predivide_factor not supported with op != Average")
    if process_set is not None:
        raise ConfigError(
            f"process_set={process_set!r}: only the global process set is supported; use "
            "torch.distributed.new_group(ranks) for a subset of ranks."
        )
    if named_parameters is not None:
        _check_names(optimizer, named_parameters)
    optimizer.__class__ = _distributed_class(type(optimizer))
    assert isinstance(optimizer, _DistributedOptimizer)
    settings = _Settings(
        compression=compression,
        passes=backward_passes_per_step,
        op=reduce_op,
        predivide=float(gradient_predivide_factor),
        sparse_as_dense=sparse_as_dense,
    )
    optimizer._hvd = settings
    for p in optimizer._params():
        settings.hooks.append(p.register_post_accumulate_grad_hook(_counter(settings)))  # type: ignore[no-untyped-call]
    optimizer._patch_step_function()
    return optimizer


def _counter(settings: _Settings) -> Callable[[torch.Tensor], None]:
    def count(p: torch.Tensor) -> None:
        seen = settings.counts.get(p, 0) + 1
        if seen > settings.passes:
            raise AssertionError(_TOO_MANY)
        settings.counts[p] = seen

    return count
