"""Activation memory of a transformer, per GPU, for one micro-batch.

The estimate is Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.1 (no tensor or sequence parallelism), in 16-bit::

    per layer  = s*b*h*34 + 5*a*s*s*b      # the second term only when attention scores are stored
    all layers = L * per layer
    with full activation checkpointing: L * 2*s*b*h (each layer's input) + one layer's activations

s sequence length, b micro-batch per GPU, h hidden size, a heads, L layers. Two additions of
ours: the logits for the loss, 4*s*b*V bytes (fp32) when the vocabulary V is known, and a factor
of 2 for ``fp32`` training (every activation twice as wide; dropout masks are really 1 byte, so
this slightly overstates). FlashAttention and PyTorch's SDPA kernels do not store the s x s
scores, hence ``attention_scores=False`` by default. Activations are the same under every data-
parallel strategy here: each GPU runs its own micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparktrain.ground.errors import ConfigError
from sparktrain.planner.bytemodel import Precision
from sparktrain.planner.model import ModelSize


@dataclass(frozen=True, kw_only=True)
class Activations:
    """The run's shape, for the activation estimate. Unset model fields come from the model.

    Attributes:
        seq_len: Tokens per sequence.
        batch_size: Sequences per micro-batch, per GPU.
        hidden_size: Hidden size; taken from the model (an HF config or a model with ``.config``)
            when ``None``.
        num_layers: Transformer layers; from the model when ``None``.
        num_heads: Attention heads; needed only with ``attention_scores=True``.
        vocab_size: Vocabulary size; adds the logits when known.
        attention_scores: Whether attention stores the ``a x s x s`` scores (eager attention);
            ``False`` for FlashAttention / SDPA.
        checkpointing: Full activation checkpointing (recompute each layer in backward).
    """

    seq_len: int
    batch_size: int
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None
    attention_scores: bool = False
    checkpointing: bool = False

    def __post_init__(self) -> None:
        optional = ("hidden_size", "num_layers", "num_heads", "vocab_size")
        for name in ("seq_len", "batch_size", *optional):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"Activations({name}={value!r}) must be a positive int, e.g. {name}=2048"
                    + (", or None to take it from the model." if name in optional else ".")
                )


@dataclass(frozen=True, kw_only=True)
class ActivationEstimate:
    """Activation bytes per GPU and the arithmetic behind them.

    Attributes:
        bytes: Activation bytes per GPU at the peak of the backward pass.
        formula: The formula with the numbers put in, for the printed assumptions.
    """

    bytes: int
    formula: str


def estimate_activations(
    spec: Activations, model: ModelSize, precision: Precision
) -> ActivationEstimate:
    """Estimate the activation memory per GPU of ``spec`` (see the module docstring).

    Raises:
        ConfigError: The hidden size or layer count is neither given nor known from the model,
            or heads are missing while ``attention_scores=True``.
    """
    h = spec.hidden_size or model.hidden_size
    layers = spec.num_layers or model.num_layers
    heads = spec.num_heads or model.num_heads
    vocab = spec.vocab_size or model.vocab_size
    if h is None or layers is None:
        raise ConfigError(
            "activations need the model's hidden size and layer count, which a bare parameter "
            "count does not give; pass Activations(hidden_size=..., num_layers=...) "
            "(--hidden-size, --layers), or a Hugging Face config as the model."
        )
    if spec.attention_scores and heads is None:
        raise ConfigError(
            "Activations(attention_scores=True) needs the head count; pass num_heads=... "
            "(--heads) or a model whose config has it."
        )
    s, b = spec.seq_len, spec.batch_size
    width = 2 if precision == "fp32" else 1
    per_layer = 34 * s * b * h + (5 * (heads or 0) * s * s * b if spec.attention_scores else 0)
    scores = " + 5*a*s^2*b" if spec.attention_scores else ""
    if spec.checkpointing:
        layer_bytes = layers * 2 * s * b * h + per_layer
        text = f"L*2*s*b*h + (34*s*b*h{scores})"
    else:
        layer_bytes = layers * per_layer
        text = f"L*(34*s*b*h{scores})"
    if width == 2:
        text = f"2*({text})"
    logits = 4 * s * b * vocab if vocab else 0
    if vocab:
        text += " + 4*s*b*V"
    values = f"s={s}, b={b}, h={h}, L={layers}" + (f", a={heads}" if spec.attention_scores else "")
    values += f", V={vocab}" if vocab else ""
    return ActivationEstimate(
        bytes=width * layer_bytes + logits,
        formula=f"activations = {text} bytes with {values} (Korthikanti et al. 2022)",
    )
