"""Tensor parallelism: split each transformer block's projections over the ``tp`` ranks.

The built-in plan finds, in every module, the pairs Megatron-LM splits:

- attention: the query/key/value projections column-wise (each rank keeps ``heads / tp``
  heads), the output projection row-wise (one all-reduce after it);
- MLP: the up (and gate) projections column-wise, the down projection row-wise;
- embeddings row-wise over the vocabulary (their output all-reduced).

Norms, the output head and everything else stay replicated, so activations between blocks are
whole on every rank (no sequence parallelism). Attention modules that count their heads in an
attribute (``n_heads``, ``num_heads``, ``num_key_value_heads``, ...) get the local count. A
``parallelize_plan`` of the user's own (fully qualified names, ``*`` wildcards, torch's styles)
replaces the built-in one. Every name must match a module: torch only warns on a miss.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
from typing import Any

from sparktrain.ground.errors import ConfigError

log = logging.getLogger("sparktrain.strategies")

#: Column-wise (output features split) and row-wise (input features split) leaf names.
COLUMN = ("wq", "wk", "wv", "q_proj", "k_proj", "v_proj", "query", "key", "value")
COLUMN_MLP = ("w1", "w3", "gate_proj", "up_proj", "fc1", "linear1")
ROW = ("wo", "o_proj", "out_proj")
ROW_MLP = ("w2", "down_proj", "fc2", "linear2")
HEADS = ("n_heads", "num_heads", "n_head", "n_kv_heads", "num_key_value_heads")


def _linears(parent: Any, names: tuple[str, ...]) -> list[str]:
    from torch import nn

    return [n for n in names if isinstance(getattr(parent, n, None), nn.Linear)]


def builtin_plan(model: Any, tp: int) -> tuple[dict[str, str], list[str]]:
    """``{qualified name: "colwise" | "rowwise" | "embedding"}`` and the attention modules.

    Raises:
        ConfigError: A layer whose width or head count ``tp`` does not divide, naming it.
    """
    from torch import nn

    plan: dict[str, str] = {}
    attention: list[str] = []
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners[id(param)] = owners.get(id(param), 0) + 1
    for name, parent in model.named_modules():
        if isinstance(parent, nn.MultiheadAttention):
            continue  # its projections are bare parameters: left replicated
        prefix = f"{name}." if name else ""
        for cols, rows in ((COLUMN, ROW), (COLUMN_MLP, ROW_MLP)):
            column, row = _linears(parent, cols), _linears(parent, rows)
            if not (column and row):
                continue
            for leaf in column:
                _divides(f"{prefix}{leaf}.out_features", getattr(parent, leaf).out_features, tp)
                plan[prefix + leaf] = "colwise"
            plan[prefix + row[0]] = "rowwise"
            if cols is COLUMN:
                attention.append(name)
        if (
            isinstance(parent, nn.Embedding)
            and parent.num_embeddings % tp == 0
            and owners[id(parent.weight)] == 1  # a weight tied to the output head stays whole
        ):
            plan[name] = "embedding"
    return plan, attention


def _divides(what: str, value: int, tp: int) -> None:
    if value % tp:
        raise ConfigError(
            f"tp={tp} does not divide {what} = {value}: every rank must hold the same share of "
            f"the layer. Use a tp that divides {value}, or a parallelize_plan that leaves it out."
        )


def _styles(plan: dict[str, str]) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    made: dict[str, Any] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    return {name: made[kind]() for name, kind in plan.items()}


def _check_names(model: Any, plan: dict[str, Any]) -> None:
    names = [n for n, _ in model.named_modules() if n]
    for key in plan:
        if not any(_matches(key, n) for n in names):
            close = difflib.get_close_matches(key, names, n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"parallelize_plan names {key!r}, which is no module of the model.{hint} Keys "
                "are qualified module names as model.named_modules() gives them ('*' matches one "
                "part)."
            )


def _matches(pattern: str, name: str) -> bool:
    parts, got = pattern.split("."), name.split(".")
    if len(parts) != len(got):
        return False
    return all(fnmatch.fnmatchcase(g, p) for p, g in zip(parts, got, strict=True))


def _local_heads(model: Any, attention: list[str], tp: int) -> None:
    for name in attention:
        module = model.get_submodule(name) if name else model
        for attr in HEADS:
            count = getattr(module, attr, None)
            if isinstance(count, int) and not isinstance(count, bool):
                _divides(f"{name or 'the model'}.{attr}", count, tp)
                setattr(module, attr, count // tp)


def apply_tensor_parallel(
    model: Any, tp_mesh: Any, plan: dict[str, Any] | None, *, part: bool = False
) -> list[str]:
    """Split ``model`` over ``tp_mesh`` in place by ``plan`` (built-in when ``None``).

    With ``part=True`` the module is one pipeline stage of a model already checked whole
    (:func:`check_plan`): it may hold nothing to split, and plan keys of other stages are skipped.

    Returns:
        The names of the modules that were split, for the log.

    Raises:
        ConfigError: A plan key that names no module; a built-in plan that finds nothing to
            split; a width or head count the degree does not divide.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = int(tp_mesh.size())
    if plan is None:
        found, attention = builtin_plan(model, tp)
        if not found and part:
            return []
        if not found:
            raise _nothing_to_split(tp)
        styles = _styles(found)
        _local_heads(model, attention, tp)
    else:
        if not isinstance(plan, dict) or not plan:
            raise ConfigError(
                f"parallelize_plan={plan!r} must be a non-empty dict of module name to a "
                "torch.distributed.tensor.parallel style (ColwiseParallel(), ...)."
            )
        if part:  # a stage of a model whose plan check_plan checked whole: its own keys
            names = [n for n, _ in model.named_modules() if n]
            plan = {k: v for k, v in plan.items() if any(_matches(k, n) for n in names)}
            if not plan:
                return []
        else:
            _check_names(model, plan)
        styles = plan
    parallelize_module(model, tp_mesh, styles)
    log.info("tensor parallel over %d ranks: %s", tp, ", ".join(sorted(styles)))
    return sorted(styles)


def check_plan(model: Any, tp: int, plan: dict[str, Any] | None) -> None:
    """Check the plan against the whole model before it is cut into pipeline stages.

    Raises:
        ConfigError: As :func:`apply_tensor_parallel` would on the whole model.
    """
    if plan is None:
        if not builtin_plan(model, tp)[0]:
            raise _nothing_to_split(tp)
    elif isinstance(plan, dict) and plan:
        _check_names(model, plan)


def _nothing_to_split(tp: int) -> ConfigError:
    return ConfigError(
        f"tp={tp}: the model has no layer the built-in plan splits (pairs of nn.Linear "
        f"named {'/'.join(COLUMN[:3])} + {ROW[0]}, q_proj/k_proj/v_proj + o_proj, "
        "w1/w3 + w2, gate_proj/up_proj + down_proj, fc1 + fc2 or linear1 + linear2, in "
        "the same module). Pass parallelize_plan={'layers.*.attn.q': ColwiseParallel(), "
        "...} with torch.distributed.tensor.parallel's styles, or use tp=1."
    )
