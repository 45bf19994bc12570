"""The files path's plan: which row groups make each output part, and what a scorer needs.

Pure values, made on the driver and sent to every scorer (a rank of a launch, or a Spark task):
nothing here reads a file or loads a model. A part is a run of consecutive row groups; its index
names its output file, so a part is written once whatever scorer writes it, and a run that
resumes knows which parts are done from the files alone.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from sparktrain.data.sources import Source
from sparktrain.ground.errors import ConfigError
from sparktrain.inference.rank import outputs

#: Rows per part unless the caller says (about one 50,000-row file of the benchmark's data).
PART_ROWS = 50_000


@dataclass(frozen=True)
class Part:
    """One output part: row groups ``units`` (indices into the source's units), in order.

    Attributes:
        index: The part's number; its output file is ``part-<index>``.
        units: The source's units it reads.
        starts: For each unit, the rows of its file before it (messages name a file's row).
        rows: Rows it reads (before any filter).
    """

    index: int
    units: tuple[int, ...]
    starts: tuple[int, ...]
    rows: int


@dataclass(frozen=True)
class ScoringPlan:
    """Everything a scorer needs; made by :func:`make_plan`.

    Attributes:
        source: The row groups to score.
        parts: The output parts.
        inputs: The columns the model takes (or that ``preprocess`` reads).
        keep: The columns handed back with the prediction, in order.
        output_col: The prediction's column.
        spec: The prediction's shape and dtype (found on the driver from the first rows).
        model_key: A hash of ``model`` (its pickle: the scorers' cache key).
        model_id: The model's class and weights, hashed (what a resumed run must match).
        model: The model, pickled.
        preprocess: The pickled ``preprocess`` function, or ``None``.
        batch_size: Rows per forward pass (per read with ``batch_tokens``).
        batch_tokens: Token budget per forward pass (rows x the padded length), or ``None``.
        use_gpu: ``True``, ``False``, or ``None`` for the scorer's GPU when it has one.
        autocast: ``"bf16"``, ``"fp16"`` or ``None``.
        row_filter: A ``pyarrow.compute.Expression`` rows must pass, or ``None``.
        filter_text: The filter as Spark wrote it, for messages and the manifest.
        filter_columns: The columns the filter reads.
    """

    source: Source
    parts: tuple[Part, ...]
    inputs: tuple[str, ...]
    keep: tuple[str, ...]
    output_col: str
    spec: outputs.Spec
    model_key: str
    model_id: str
    model: bytes
    preprocess: bytes | None
    batch_size: int
    batch_tokens: int | None
    use_gpu: bool | None
    autocast: str | None
    row_filter: Any = None
    filter_text: str = ""
    filter_columns: tuple[str, ...] = ()

    @property
    def read_columns(self) -> tuple[str, ...]:
        """The columns read from the files: inputs, kept columns and filtered columns."""
        names = [*self.inputs, *self.keep, *self.filter_columns]
        return tuple(dict.fromkeys(n for n in names if n in self.source.schema.names))

    def output_schema(self) -> Any:
        """The Arrow schema of every output part: the kept columns, then the prediction."""
        import pyarrow as pa

        fields = [self.source.schema.field(n) for n in self.keep]
        return pa.schema([*fields, pa.field(self.output_col, outputs.arrow_type(self.spec))])

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a run to resume another's output (the manifest's content)."""
        units = hashlib.sha256(
            json.dumps([[u.file, u.row_group, u.rows] for u in self.source.units]).encode()
        ).hexdigest()[:32]
        hook = hashlib.sha256(self.preprocess).hexdigest()[:32] if self.preprocess else None
        return {
            "units": units,
            "parts": [[p.index, list(p.units)] for p in self.parts],
            "inputs": list(self.inputs),
            "keep": list(self.keep),
            "output_col": self.output_col,
            "model": self.model_id,
            "preprocess": hook,
            "filter": self.filter_text,
            "autocast": self.autocast,
            "output": str(self.spec),
        }


def plan_parts(source: Source, rows_per_part: int) -> tuple[Part, ...]:
    """Consecutive row groups in parts of about ``rows_per_part`` rows.

    A part ends at the first row group that brings it to ``rows_per_part``.
    """
    starts: list[int] = []
    seen: dict[str, int] = {}
    for unit in source.units:
        starts.append(seen.get(unit.file, 0))
        seen[unit.file] = starts[-1] + unit.rows
    parts: list[Part] = []
    current: list[int] = []
    rows = 0
    for index, unit in enumerate(source.units):
        current.append(index)
        rows += unit.rows
        if rows >= rows_per_part:
            parts.append(Part(len(parts), tuple(current), tuple(starts[i] for i in current), rows))
            current, rows = [], 0
    if current:
        parts.append(Part(len(parts), tuple(current), tuple(starts[i] for i in current), rows))
    return tuple(parts)


def check_columns(source: Source, names: tuple[str, ...], what: str) -> None:
    """Refuse columns the source does not have, listing those it has."""
    missing = [n for n in names if n not in source.schema.names]
    if missing:
        raise ConfigError(
            f"{what} {missing} not in {source.name!r}; it has the columns {source.schema.names}."
        )
