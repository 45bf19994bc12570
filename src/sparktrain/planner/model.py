"""How big a model is: count its parameters from a number, a module or a Hugging Face config.

Design choices:
- Nothing heavy is imported here. A module is recognised through ``sys.modules["torch"]``: whoever
  holds an ``nn.Module`` has imported torch already. torch is imported only to build a model from a
  factory, on the meta device, so that no parameter memory is allocated.
- A Hugging Face config is duck-typed (an object with attributes, or the ``config.json`` dict), and
  transformers is never imported. Its size comes from the decoder-only transformer formula
  (Llama-style blocks; exact for Llama 2 7B/13B/70B)::

      params = V*h*(1 if tied else 2) + L*(attn + mlp + 2*h) + h
      attn   = 2*h*(a*d) + 2*h*(k*d)          # q, o; k, v with k key/value heads of width d
      mlp    = (3 if gated else 2) * h * i     # gate/up/down (SwiGLU) or up/down

  V vocabulary, h hidden size, L layers, a heads, d = h/a head width, i intermediate size (4*h
  when absent). Biases and learned position embeddings are left out (GPT-2 small: 0.7 % under).
  Mixture-of-experts configs are refused: the formula would be wrong.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sparktrain.ground.errors import ConfigError
from sparktrain.planner.units import format_count, parse_count

_GATED_ACTIVATIONS = ("silu", "swish", "swiglu", "geglu")
_GATED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "phi3")
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True, kw_only=True)
class ModelSize:
    """A model's parameter count and, when known, its shape.

    Attributes:
        params: Parameters (shared ones counted once).
        trainable_params: Parameters that get gradients and optimizer states (``params`` unless
            some are frozen, e.g. LoRA).
        source: Where the count came from, for the printed assumptions.
        hidden_size: Transformer hidden size, if known.
        num_layers: Transformer layers, if known.
        num_heads: Attention heads, if known.
        vocab_size: Vocabulary size, if known.
        largest_layer_params: Parameters of the largest single module (ZeRO-3 gathers one at a
            time), if known.
    """

    params: int
    trainable_params: int
    source: str
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None
    largest_layer_params: int | None = None


def model_size(model: object) -> ModelSize:
    """Count the parameters of ``model`` without allocating them.

    Args:
        model: A count (``13_000_000_000``, ``"13B"``), an ``nn.Module`` (built on the meta
            device, say), a zero-argument callable that builds one (it is called on the meta
            device), a Hugging Face config (object or ``config.json`` dict) of a decoder-only
            transformer, or a :class:`ModelSize`.

    Raises:
        ConfigError: ``model`` is none of these, or a config lacks the fields the formula needs.
    """
    if isinstance(model, ModelSize):
        return model
    if isinstance(model, (int, float, str)):
        count = parse_count(model, name="model_or_param_count")
        return ModelSize(params=count, trainable_params=count, source=f"{model!r} parameters")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return _count_module(model)
    if _field(model, "hidden_size", "n_embd", "d_model") is not None:
        return _from_config(model)
    if callable(model):
        return _count_module(_build_on_meta(model))
    raise ConfigError(
        f"model_or_param_count={model!r} ({type(model).__name__}) is not a model; pass a "
        "parameter count like '13B', an nn.Module (e.g. built under torch.device('meta')), or a "
        "Hugging Face config."
    )


def _build_on_meta(factory: Callable[[], Any]) -> Any:
    import torch

    with torch.device("meta"):
        built = factory()
    if not isinstance(built, torch.nn.Module):
        raise ConfigError(
            f"model_or_param_count={factory!r} returned {type(built).__name__}, not an "
            "nn.Module; pass a callable that builds the model, or the model itself."
        )
    return built


def _count_module(module: Any) -> ModelSize:
    total = trainable = 0
    for param in module.parameters():  # shared parameters come once
        total += param.numel()
        if param.requires_grad:
            trainable += param.numel()
    if total == 0:
        raise ConfigError(
            f"{type(module).__name__} has no parameters; pass the model you will train."
        )
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())
    config = getattr(module, "config", None)  # a Hugging Face model's, for the shape
    try:
        shape = _shape(config) if _field(config, "hidden_size", "n_embd", "d_model") else {}
    except ConfigError:  # the count stands; only the activation estimate would need the shape
        shape = {}
    return ModelSize(
        params=total,
        trainable_params=trainable,
        source=f"{type(module).__name__} (nn.Module, {format_count(total)} parameters counted)",
        largest_layer_params=largest,
        **shape,
    )


def _field(config: object, *names: str) -> Any:
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return None


def _positive(config: object, what: str, *names: str, default: int | None = None) -> int:
    value = _field(config, *names)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        found = "missing" if value is None else f"{value!r}"
        raise ConfigError(
            f"the config's {what} ({' or '.join(names)}) is {found}; the decoder-only formula "
            "needs a positive int. Build the model on the meta device and pass the module instead."
        )
    return value


def _shape(config: object) -> dict[str, int]:
    hidden = _positive(config, "hidden size", "hidden_size", "n_embd", "d_model")
    return {
        "hidden_size": hidden,
        "num_layers": _positive(
            config, "layer count", "num_hidden_layers", "n_layer", "num_layers"
        ),
        "num_heads": _positive(config, "head count", "num_attention_heads", "n_head"),
        "vocab_size": _positive(config, "vocabulary size", "vocab_size"),
    }


def _from_config(config: object) -> ModelSize:
    experts = _field(config, *_EXPERT_KEYS)
    if isinstance(experts, int) and experts > 1:
        raise ConfigError(
            f"the config describes a mixture of experts ({experts} experts); the planner's "
            "formula covers dense decoder-only transformers. Build the model under "
            "torch.device('meta') and pass the module."
        )
    shape = _shape(config)
    h, layers, heads, vocab = (
        shape["hidden_size"],
        shape["num_layers"],
        shape["num_heads"],
        shape["vocab_size"],
    )
    head_dim = _positive(config, "head width", "head_dim", default=h // heads)
    kv_heads = _positive(config, "key/value heads", "num_key_value_heads", default=heads)
    inner = _positive(config, "intermediate size", "intermediate_size", "n_inner", default=4 * h)
    act = str(_field(config, "hidden_act", "activation_function") or "").lower()
    model_type = str(_field(config, "model_type") or "").lower()
    gated = model_type in _GATED_MODEL_TYPES or any(a in act for a in _GATED_ACTIVATIONS)
    tied = bool(_field(config, "tie_word_embeddings") is not False)
    attn = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
    mlp = (3 if gated else 2) * h * inner
    params = vocab * h * (1 if tied else 2) + layers * (attn + mlp + 2 * h) + h
    name = model_type or type(config).__name__
    return ModelSize(
        params=params,
        trainable_params=params,
        source=(
            f"{name} config, decoder-only formula ({'gated' if gated else 'plain'} MLP, "
            f"{'tied' if tied else 'untied'} embeddings): {format_count(params)} parameters"
        ),
        largest_layer_params=max(vocab * h, h * heads * head_dim, h * inner),
        **shape,
    )
