"""The model on the driver: loaded from what the caller gave, pickled once for the scorers."""

from __future__ import annotations

import hashlib
from typing import Any

from sparktrain.ground.errors import ConfigError
from sparktrain.inference.rank.batches import float_dtype


def model_payload(model: Any) -> tuple[str, bytes]:
    """The model pickled for the executors, and its key."""
    import cloudpickle

    try:
        payload = cloudpickle.dumps(model)
    except Exception as exc:
        raise ConfigError(
            f"the model ({type(model).__name__}) cannot be pickled for the executors: {exc}. "
            "Define its class at the top level of a module or notebook cell."
        ) from exc
    return hashlib.sha256(payload).hexdigest()[:32], payload


def load_model(model: Any) -> Any:
    """``model`` itself, or for a string the PyTorch model of that MLflow URI (on the CPU)."""
    if not isinstance(model, str):
        if not callable(model):
            raise ConfigError(
                f"model={model!r} must be a torch module, a function of tensors, or an MLflow "
                "model URI such as 'runs:/<run id>/model'."
            )
        return model
    from sparktrain.driver.tracking import mlflow_module

    mlflow = mlflow_module()
    try:
        flavors = mlflow.models.get_model_info(model).flavors
    except Exception as exc:
        raise ConfigError(f"MLflow model {model!r} could not be read: {exc}") from exc
    if "pytorch" not in flavors:
        raise ConfigError(
            f"MLflow model {model!r} has the flavors {sorted(flavors)}, not pytorch; score it "
            "with mlflow.pyfunc.spark_udf."
        )
    return mlflow.pytorch.load_model(model, map_location="cpu")


def model_identity(model: Any, payload: bytes) -> str:
    """What makes two models the same for resuming a scoring: a module's class and weights.

    Pickles of one model made in two processes may differ; for a function, its pickle it is.
    """
    import torch

    digest = hashlib.sha256()
    if isinstance(model, torch.nn.Module):
        digest.update(type(model).__qualname__.encode())
        for name, entry in model.state_dict().items():
            if not isinstance(entry, torch.Tensor):  # a quantised model's dtype, say
                digest.update(f"{name}:{entry!r}".encode())
                continue
            value = entry.detach().cpu().contiguous()
            digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
            if value.numel():  # 0-dim tensors (BatchNorm's counter) too
                digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        digest.update(payload)
    return digest.hexdigest()[:32]


def run_sample(
    model: Any,
    table: Any,
    inputs: tuple[str, ...],
    *,
    preprocess: Any = None,
    autocast: str | None = None,
) -> Any:
    """The model's output on the Arrow ``table`` (a few first rows), computed here on the CPU.

    This finds the output's type before any scorer starts, and shows a model or ``preprocess``
    that fails on the data at once, in the caller's process.
    """
    import torch

    from sparktrain.inference.rank.batches import Where, forward, input_tensors
    from sparktrain.inference.rank.reading import as_call, as_float32

    training = getattr(model, "training", None)
    if training is not None:
        model.eval()
    try:
        params = list(getattr(model, "parameters", list)())
        device = params[0].device if params else torch.device("cpu")
        if preprocess is not None:
            call = as_call(preprocess(table.select(list(inputs))), "the first rows")
        else:
            arrays = [table.column(n).combine_chunks() for n in inputs]
            widths: list[int | None] = [None] * len(inputs)
            dtype = float_dtype(model)
            call = tuple(input_tensors(arrays, inputs, widths, Where(None), dtype)), {}
        with torch.inference_mode():
            output = next(forward(model, iter([call]), device, autocast))
        return as_float32(output) if autocast else output
    finally:
        if training:
            model.train()
