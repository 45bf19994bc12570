"""The run's shape as :func:`sparktrain.planner.plan` takes it, checked and made into values.

Runs wherever ``plan()`` runs (the caller's process); pure. ``plan()`` takes the shape two ways,
``activation=Activations(...)`` or ``layers=``, ``hidden=``, ``seq_len=``, ``micro_batch=``...;
:func:`activation_shape` makes the second into the first and refuses both at once.
:func:`mesh_spec` adds what the model gives (its layers, hidden size, heads, vocabulary) for the
tensor x pipeline x FSDP meshes.
"""

from __future__ import annotations

from sparktrain.ground.errors import ConfigError
from sparktrain.planner.activations import Activations
from sparktrain.planner.bytemodel import Precision
from sparktrain.planner.mesh import MeshShapeSpec
from sparktrain.planner.model import ModelSize


def activation_shape(
    activation: Activations | None,
    *,
    layers: int | None,
    hidden: int | None,
    vocab: int | None,
    seq_len: int | None,
    micro_batch: int | None,
) -> Activations | None:
    """``activation``, or the one the other arguments make (``None`` when none is given).

    Raises:
        ConfigError: The shape is given both ways, or without ``seq_len`` and ``micro_batch``.
    """
    given = dict(
        layers=layers, hidden=hidden, vocab=vocab, seq_len=seq_len, micro_batch=micro_batch
    )
    named = {k: v for k, v in given.items() if v is not None}
    if not named:
        return activation
    if activation is not None:
        raise ConfigError(
            f"plan() got activation=... and {', '.join(named)}: give the shape one way."
        )
    if seq_len is None or micro_batch is None:
        raise ConfigError(
            f"plan({', '.join(f'{k}={v}' for k, v in named.items())}) needs seq_len and "
            "micro_batch as well (tokens per sequence, sequences per GPU per micro-batch), e.g. "
            "seq_len=4096, micro_batch=1."
        )
    return Activations(
        seq_len=seq_len,
        batch_size=micro_batch,
        hidden_size=hidden,
        num_layers=layers,
        vocab_size=vocab,
    )


def mesh_spec(
    size: ModelSize,
    act: Activations,
    precision: Precision,
    microbatches: int | None,
    tied: bool,
) -> MeshShapeSpec:
    """The model's shape for the meshes: ``act``'s where it gives one, else ``size``'s.

    Raises:
        ConfigError: ``microbatches`` is not a positive int.
    """
    if microbatches is not None:
        check_count("microbatches", microbatches)
    layers = act.num_layers or size.num_layers
    hidden = act.hidden_size or size.hidden_size
    assert layers is not None and hidden is not None  # estimate_activations checked them
    return MeshShapeSpec(
        params=size.params,
        trainable_params=size.trainable_params,
        layers=layers,
        hidden=hidden,
        heads=act.num_heads or size.num_heads or 1,
        vocab=act.vocab_size or size.vocab_size or 0,
        tied=tied,
        seq_len=act.seq_len,
        micro_batch=act.batch_size,
        microbatches=microbatches,
        width=2 if precision == "fp32" else 1,
        checkpointing=act.checkpointing,
        attention_scores=act.attention_scores,
    )


def check_count(name: str, value: object) -> int:
    """``value``, a positive int; else a ConfigError that names it with an example."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive int, e.g. {name}=4.")
    return value
