"""Streaming data into the ranks: Parquet files, Delta tables and Spark DataFrames.

Build the dataset once (in the caller, or in every rank) and iterate it in every rank::

    import sparktrain
    from sparktrain import data

    ds = data.from_parquet("s3://bucket/train/", batch_size=256, columns=["features", "label"])

    def train(ds):
        for epoch in range(3):
            for batch in ds.loader(num_workers=2):     # ds.set_epoch is done for you
                features, label = batch["features"], batch["label"]
                ...

    sparktrain.launch(train, ds, num_processes=2)

Each rank reads only its share, a shuffle window at a time; every rank yields the same number of
batches; ``ds.state_dict()`` saved in a checkpoint resumes mid-epoch, at the same world size or
at another (docs/data.md, "Resumption").

Inside a rank started by ``TorchDistributor.train_on_dataframe``, :func:`rank_dataloader` and
:func:`rank_dataset` give the rank's share of that DataFrame.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from sparktrain.data.dataset import StreamingDataset
from sparktrain.data.loader import StreamingLoader
from sparktrain.data.shard import ShardDataset, rank_dataloader, rank_dataset

__all__ = [
    "ShardDataset",
    "StreamingDataset",
    "StreamingLoader",
    "delete_cache",
    "from_arrow",
    "from_dataframe",
    "from_delta",
    "from_parquet",
    "materialise",
    "rank_dataloader",
    "rank_dataset",
]


def from_parquet(
    path: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> StreamingDataset:
    """Stream a Parquet file, folder or glob (local, ``file://``, ``s3://``, ``gs://``, ...).

    ``options`` are :class:`StreamingDataset`'s (``batch_size``, ``columns``, ``shuffle``, ...).
    """
    from sparktrain.data.sources import parquet_source

    return StreamingDataset(parquet_source(path, storage_options=storage_options), **options)


def from_arrow(
    path: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> StreamingDataset:
    """Stream Arrow IPC files (Feather v2, ``.arrow``): a file, a folder or a glob.

    ``options`` are :class:`StreamingDataset`'s, as for :func:`from_parquet`.
    """
    from sparktrain.data.sources import arrow_source

    return StreamingDataset(arrow_source(path, storage_options=storage_options), **options)


def from_delta(
    path: str | os.PathLike[str],
    *,
    version: int | None = None,
    timestamp: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> StreamingDataset:
    """Stream a Delta table (latest, or at ``version`` or ``timestamp``), read without Spark."""
    from sparktrain.data.sources import delta_source

    source = delta_source(
        path, version=version, timestamp=timestamp, storage_options=storage_options
    )
    return StreamingDataset(source, **options)


def materialise(df: Any, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Have Spark write ``df`` as Parquet to the cache (or reuse it); the folder's URL."""
    from sparktrain.data.cache import materialise as write

    return write(df, cache_dir)


def from_dataframe(
    df: Any, *, cache_dir: str | os.PathLike[str] | None = None, **options: Any
) -> StreamingDataset:
    """Stream a Spark DataFrame (classic or Connect): Spark writes it to the cache first.

    The executors write the rows as Parquet in parallel (nothing is collected to the driver);
    the same DataFrame later reuses the cache. ``cache_dir`` (or the Spark conf
    ``spark.sparktrain.data.cacheDir``) must be readable by every rank; in local mode a private
    temporary folder is the default (docs/data.md, "The cache").
    """
    return from_parquet(materialise(df, cache_dir), **options)


def delete_cache(df_or_path: Any, cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """Remove the cache of a DataFrame (or a folder :func:`materialise` returned)."""
    from sparktrain.data.cache import delete

    return delete(df_or_path, cache_dir)
