"""``predict``'s files path: a lazy Spark DataFrame whose rows the Python workers read from files.

The DataFrame is ``spark.range(parts)`` mapped with ``mapInArrow``: each Spark task gets part
numbers (a few bytes), reads those parts' row groups from the files itself
(:mod:`sparktrain.inference.rank.reading`), runs the model, and returns only the kept columns and
the prediction as Arrow. So the input column never goes from the JVM to Python; only what the user
keeps comes back. ``mapInArrow`` is in every pyspark from 3.3, classic and Connect, so the path is
the same on all of them (pyspark 4's Python Data Source API would add nothing here: the reading is
ours either way).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sparktrain.inference.rank.parts import ScoringPlan

#: Rows per Arrow batch handed to the JVM: fewer, larger batches cost the JVM less per row
#: (1,024-row batches made the whole path 1.25x slower here).
JVM_BATCH_ROWS = 10_000


def output_schema(plan: ScoringPlan, kept: Any = None) -> Any:
    """The DataFrame's Spark schema: the kept columns, then the prediction.

    The kept columns take ``kept``'s types (the scanned DataFrame's own) or, for files given by
    path, the files' types.

    Raises:
        ConfigError: A kept column of a type Spark cannot hold (uint32 read by path, say).
    """
    from pyspark.sql import types as T
    from pyspark.sql.pandas.types import from_arrow_type

    from sparktrain.ground.errors import ConfigError
    from sparktrain.inference.rank import outputs

    fields = []
    for name in plan.keep:
        if kept is not None:
            fields.append(kept[name])
            continue
        kind = plan.source.schema.field(name).type
        try:
            fields.append(T.StructField(name, from_arrow_type(kind)))
        except Exception as exc:
            raise ConfigError(
                f"the kept column {name!r} holds {kind}, which a Spark DataFrame cannot hold "
                f"({exc}); leave it out of keep_cols."
            ) from exc
    return T.StructType([*fields, T.StructField(plan.output_col, outputs.spark_type(plan.spec))])


def scored_dataframe(spark: Any, plan: ScoringPlan, kept: Any = None) -> Any:
    """The plan's output as a DataFrame (one Spark task per part; nothing runs until an action).

    ``kept``: the scanned DataFrame's schema, whose types the kept columns take (pyarrow reads
    Spark's INT96 timestamps as nanoseconds, unsigned integers as such: they are cast).
    """
    from pyspark.sql.pandas.types import to_arrow_schema

    schema = output_schema(plan, kept)
    target = to_arrow_schema(schema)
    parts = len(plan.parts)

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        from sparktrain.inference.rank.reading import coalesced, score_part
        from sparktrain.spark.rank.scoring import task_device

        device = task_device(plan.use_gpu)
        for batch in batches:
            for index in batch.column(0).to_pylist():
                scored = score_part(plan, plan.parts[index], device)
                for out in coalesced(scored, JVM_BATCH_ROWS):
                    if out.schema.equals(target):
                        yield out
                    else:
                        yield from (
                            pa.Table.from_batches([out]).cast(target, safe=False).to_batches()
                        )

    return spark.range(0, parts, 1, numPartitions=parts).mapInArrow(run, schema)
