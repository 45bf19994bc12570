"""Batch inference over files: :func:`score` writes predictions as Parquet or Delta files.

The rows never pass through Spark's JVM: each rank of a launch (on this machine, on Spark
executors or on Ray) reads its parts' row groups from the files, runs the model, and writes the
part's output file atomically (:mod:`sparktrain.inference.rank.files`). A run killed half way,
or a rank restarted by ``max_restarts``, resumes: parts already written are not scored again,
and every input row has exactly one output row. :func:`make_plan` is shared with
``sparktrain.spark.predict``, which hands the same parts back as a Spark DataFrame.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sparktrain.backends.base import Backend
from sparktrain.backends.registry import BackendName, backend_class
from sparktrain.data.sources import Source
from sparktrain.ground.errors import ConfigError
from sparktrain.inference.planning import ScoringArgs, as_source, make_plan, positive
from sparktrain.inference.rank import files, reading
from sparktrain.inference.rank.parts import ScoringPlan
from sparktrain.launchplan.option_docs import documents_options


@dataclass(frozen=True)
class ScoreResult:
    """What :func:`score` did.

    Attributes:
        output: The output folder.
        parts: Parts in the output.
        rows: Rows in the output.
        scored_parts: Parts this call scored (the others were done before it).
        seconds: How long the call took.
        peak_rss: The largest peak resident memory of a rank, in bytes (0 if none ran).
        scoring_seconds: The longest rank's time scoring, from its first read to its last
            write (the call less the ranks' start-up and the listing and checks around them;
            each rank's own clock; 0 if none ran). With ``max_restarts``, the last attempt's,
            while ``rows`` counts every attempt's.
    """

    output: str
    parts: int
    rows: int
    scored_parts: int
    seconds: float
    peak_rss: int = 0
    scoring_seconds: float = 0.0


@documents_options
def score(
    data: Any,
    model: Any,
    *,
    output: str | os.PathLike[str],
    input_cols: str | Sequence[str],
    keep_cols: str | Sequence[str] | None = None,
    output_col: str = "prediction",
    format: str = "parquet",
    preprocess: Callable[[Any], Any] | None = None,
    batch_size: int = 1024,
    batch_tokens: int | None = None,
    rows_per_part: int | None = None,
    use_gpu: bool | None = None,
    autocast: str | None = None,
    overwrite: bool = False,
    num_processes: int | None = None,
    backend: BackendName | Backend = "local",
    storage_options: Mapping[str, Any] | None = None,
    **run_options: Any,
) -> ScoreResult:
    """Score every row of ``data`` with ``model``; write the predictions to ``output``.

    Args:
        data: Parquet files (a file, folder or glob; local or a URL), a Delta table's folder, a
            ``sparktrain.data`` dataset or source.
        model: A ``torch.nn.Module`` (or any function of tensors), or an MLflow model URI of a
            PyTorch model (``runs:/<run id>/model``).
        output: The folder to write: one Parquet file per part (docs/spark-ml.md, "Inference
            at scale").
        input_cols: The columns the model takes, in order (numbers, arrays of numbers), or
            that ``preprocess`` reads.
        keep_cols: Columns written with the prediction (an id, say).
        output_col: The prediction's column.
        format: ``"parquet"`` or ``"delta"`` (one commit when every part is written).
        preprocess: A function of an Arrow table of ``input_cols`` that returns the model's
            inputs: a tensor, a tuple of tensors, or a dict of tensors (keyword arguments, as a
            Hugging Face tokenizer returns). It runs in the ranks, beside the reading.
        batch_size: Rows read at a time, and per forward pass.
        batch_tokens: With ``preprocess``: at most this many tokens (rows x padded length)
            per forward pass.
        rows_per_part: Rows per output part (about; whole row groups), 50,000 by default.
        use_gpu: ``True``: each rank's GPU; ``False``: the CPU; ``None``: the GPU when torch
            sees one.
        autocast: ``"bf16"`` or ``"fp16"`` to run the forward pass in half precision.
        overwrite: Delete what ``output`` holds first; else a run of the same scoring resumes.
        num_processes: Ranks; by default this machine's GPUs where the ranks use them, else
            its CPUs (at most one rank per part). Give it for ``backend="spark"`` or ``"ray"``.
        backend: ``"local"``, ``"spark"`` or ``"ray"``, as for :func:`sparktrain.launch`.
        storage_options: Credentials for a remote ``data`` or ``output`` (as fsspec takes).
        **run_options: Run options of :func:`sparktrain.launch` by name
            (:class:`~sparktrain.RunOptions`; ``return_all`` is set for you):

            {run_options}

    Returns:
        A :class:`ScoreResult`.

    Raises:
        ConfigError: A bad argument, a missing column, or an output folder holding another
            scoring. Errors in the ranks (a null, a row of the wrong length, a file that cannot
            be read) name the file and the row.
    """
    started = time.monotonic()
    target = _output_path(output)
    source = as_source(data, storage_options)
    args = ScoringArgs(
        input_cols=input_cols, keep_cols=keep_cols, output_col=output_col, preprocess=preprocess,
        batch_size=batch_size, batch_tokens=batch_tokens, rows_per_part=rows_per_part,
        use_gpu=use_gpu, autocast=autocast,
    )  # fmt: skip
    plan = make_plan(source, model, args)
    _check_apart(source, target)
    files.check_format(format, plan.output_schema())
    done, finished = files.prepare(
        target, plan.fingerprint(), fmt=format, overwrite=overwrite, storage_options=storage_options
    )
    todo = tuple(p.index for p in plan.parts if p.index not in done)
    slots = functools.partial(_local_slots, use_gpu, run_options)
    ranks = _ranks(num_processes, backend, target, len(todo), slots)
    _say(
        f"{len(plan.parts)} parts ({source.rows:,} rows) of {source.name} -> {target}, read from "
        f"the files by {ranks} rank(s) on {getattr(backend, 'name', backend)}"
        + (f"; {len(done)} part(s) already written, not scored again" if done else "")
    )
    peak, scoring = 0, 0.0
    if todo and not finished:
        peak, scoring = _run_ranks(plan, target, todo, storage_options, ranks, backend, run_options)
    if finished:
        rows = sum(_rows_in(target, storage_options))
    else:
        rows = files.finish(
            target, len(plan.parts), plan.output_schema(), fmt=format,
            storage_options=storage_options,
        )  # fmt: skip
    seconds = time.monotonic() - started
    return ScoreResult(target, len(plan.parts), rows, len(todo), seconds, peak, scoring)


def _output_path(output: str | os.PathLike[str]) -> str:
    """``output`` as the ranks must see it: a URL as it is, a local path made absolute."""
    target = os.fspath(output)
    if "://" not in target and not target.startswith("dbfs:/"):
        target = os.path.abspath(os.path.expanduser(target))  # the ranks' working folder differs
    return target


def _say(line: str) -> None:
    print(f"sparktrain.score: {line}", file=sys.stderr, flush=True)


def _local_slots(use_gpu: bool | None, run_options: Mapping[str, Any]) -> int:
    """Ranks a local run starts by default: the GPUs where the ranks use them, else the CPUs.

    The ranks use GPUs unless ``use_gpu`` is ``False``; the GPUs are the ones the launch sees.
    """
    from sparktrain.backends.local.topology import local_topology

    topology = run_options.get("topology") or local_topology(use_gpu)
    return len(topology.gpus) if topology.gpus and use_gpu is not False else topology.cpus


def _ranks(
    num_processes: int | None, backend: object, target: str, parts: int, slots: Callable[[], int]
) -> int:
    """The ranks to start (by default ``slots()``, at most one per part to score).

    Says on stderr when a cluster's ranks would write a local path.

    Raises:
        ConfigError: ``num_processes`` is missing for a cluster, or not a positive number.
    """
    here = backend_class(backend).on_this_machine
    if num_processes is None:
        if not here:
            raise ConfigError(f"backend={backend!r}: give num_processes, the number of ranks.")
        num_processes = max(1, min(slots(), parts))
    positive("num_processes", num_processes)
    if not here and "://" not in target:
        _say(
            f"output={target!r} is a local path; with backend={backend!r} every rank writes to "
            "its own machine's disk, so on a cluster it must be a shared mount (or pass a URL: "
            "s3://, abfss://, dbfs:/ ...)"
        )
    return num_processes


def _run_ranks(  # noqa: PLR0917 - one private caller: score()
    plan: ScoringPlan,
    target: str,
    todo: tuple[int, ...],
    storage_options: Mapping[str, Any] | None,
    ranks: int,
    backend: BackendName | Backend,
    run_options: Mapping[str, Any],
) -> tuple[int, float]:
    """Score the parts ``todo`` on ``ranks`` ranks.

    Returns:
        The largest peak memory of a rank, in bytes, and the longest rank's seconds scoring.
    """
    from sparktrain.driver.launch import launch

    run = launch(
        reading.score_rank,
        args=(plan, target, todo, storage_options),
        num_processes=min(ranks, len(todo)),
        backend=backend,
        use_gpu=plan.use_gpu,
        **{**run_options, "return_all": True},
    )
    values = [value for value in run.return_values.values() if value]
    if not values:
        return 0, 0.0
    return max(v[1] for v in values), max(v[2] for v in values)


def _check_apart(source: Source, output: str) -> None:
    """Refuse an output folder that holds input files, or that lies in the input's folder.

    (A later listing of that folder would take the predictions for input.)
    """
    import pyarrow.fs as pafs

    from sparktrain.data.sources import filesystem_of

    _, inner = filesystem_of(output)
    folder = inner.rstrip("/") + "/"
    clash = next((u.file for u in source.units if u.file.startswith(folder)), None)
    try:
        fs, given = filesystem_of(source.name.split("*")[0])
        inside = folder.startswith(given.rstrip("/") + "/")
        if inside and fs.get_file_info(given).type == pafs.FileType.Directory:
            clash = given
    except Exception:  # a name that is not a path (a Delta table's "path (version 3)", say)
        pass
    if clash is not None:
        raise ConfigError(
            f"output={output!r} and the input ({clash}) are one folder or one inside the "
            "other; write the predictions to a folder apart from the input."
        )


def _rows_in(output: str, storage_options: Mapping[str, Any] | None) -> list[int]:
    import pyarrow.parquet as pq

    from sparktrain.data.sources import filesystem_of

    fs, folder = filesystem_of(output, storage_options)
    return [
        pq.ParquetFile(f"{folder}/{files.part_name(i)}", filesystem=fs).metadata.num_rows
        for i in sorted(files.done_parts(output, storage_options))
    ]
