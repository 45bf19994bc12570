"""``predict``'s files path: a lazy Spark DataFrame whose rows the Python workers read from files.

The DataFrame is ``spark.range(parts)`` mapped with ``mapInArrow``: each Spark task gets part
numbers (a few bytes), reads those parts' row groups from the files itself
(:mod:`sparktrain.inference.reading`), runs the model, and returns only the kept columns and the
prediction as Arrow. So the input column never goes from the JVM to Python; only what the user
keeps comes back. ``mapInArrow`` is in every pyspark from 3.3, classic and Connect, so the path
is the same on all of them (pyspark 4's Python Data Source API would add nothing here: the
reading is ours either way).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sparktrain.inference.parts import ScoringPlan

#: Rows per Arrow batch handed to the JVM: fewer, larger batches cost the JVM less per row
#: (1,024-row batches made the whole path 1.25x slower here).
JVM_BATCH_ROWS = 10_000


def scored_dataframe(spark: Any, plan: ScoringPlan) -> Any:
    """The plan's output as a DataFrame (one Spark task per part; nothing runs until an action)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    schema = from_arrow_schema(plan.output_schema())
    parts = len(plan.parts)

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        from sparktrain.inference.reading import coalesced, score_part
        from sparktrain.spark.scoring import task_device

        device = task_device(plan.use_gpu)
        for batch in batches:
            for index in batch.column(0).to_pylist():
                yield from coalesced(score_part(plan, plan.parts[index], device), JVM_BATCH_ROWS)

    return spark.range(0, parts, 1, numPartitions=parts).mapInArrow(run, schema)
