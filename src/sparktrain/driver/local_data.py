"""A DataFrame's rows shared among local ranks: collected as Arrow, split, padded, written."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sparktrain.data import arrow
from sparktrain.rank import rundirs
from sparktrain.rank.paths import share_path


@contextmanager
def local_shares(dataframe: Any, ranks: int) -> Iterator[list[str]]:
    """Write each rank's share of ``dataframe`` to a private file; remove them afterwards."""
    table = dataframe.toArrow()
    shares = arrow.split(table, ranks)
    target = max(share.num_rows for share in shares)
    folder = rundirs.make("data")
    try:
        paths = [str(share_path(folder, rank)) for rank in range(ranks)]
        arrow.write_shares(shares, target, paths, 0)
        yield paths
    finally:
        shutil.rmtree(folder, ignore_errors=True)
