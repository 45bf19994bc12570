"""The trained parameters of an in-place rank, and their gradients as views of one buffer."""

from __future__ import annotations

from typing import Any

from sparktrain.ground.errors import ConfigError


def trained_params(model: Any) -> list[Any]:
    """The model's trained parameters, on the CPU (or a clear error)."""
    params = [p for p in model.parameters() if p.requires_grad]
    devices = sorted({str(p.device) for p in params})
    if devices != ["cpu"]:
        raise ConfigError(
            f"sparktrain.elastic.in_place trains a model on the CPU over gloo today; this one "
            f"has parameters on {devices}. Keep the model on the CPU, or leave in_place out "
            "(an elastic run then restarts from its checkpoint on GPUs)."
        )
    return params


def grad_views(params: list[Any], flat: Any) -> list[Any]:
    """Make each parameter's gradient a view of ``flat`` (in order); return the views.

    ``backward()`` then writes the gradients where the reduction reads them.
    """
    views, offset = [], 0
    for p in params:
        view = flat[offset : offset + p.numel()].view_as(p)
        p.grad = view
        views.append(view)
        offset += p.numel()
    return views


def use_views(params: list[Any], views: list[Any]) -> None:
    """Put this step's gradients in ``views``.

    The loop may have set them to None or replaced them since :func:`grad_views`.
    """
    for p, view in zip(params, views, strict=True):
        if p.grad is not view:
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view
