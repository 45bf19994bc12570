"""The same calls through a Spark Connect session (a Connect server on loopback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark

CLIENT = """
import sys
from pyspark.sql import SparkSession
from sparktrain import TorchDistributor, TrainingFailedError

def train():
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print("all_reduce gave", t.item())
    return dist.get_rank(), t.item()

def total(dataset):
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    mine = torch.tensor([sum(int(b["id"].sum()) for b in dataset)])
    dist.all_reduce(mine)
    return int(mine)

def fail():
    import os
    if os.environ["RANK"] == "1":
        raise KeyError("no such column")

if __name__ == "__main__":
    spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
    print("RESULT", TorchDistributor(2, False, False).run(train))
    from sparktrain.data import from_dataframe
    dataset = from_dataframe(spark.range(0, 30, 1, 2), batch_size=4)
    print("DATA", dataset.source.rows, TorchDistributor(2, False, False).run(total, dataset))
    try:
        TorchDistributor(2, False, False).run(fail)
    except TrainingFailedError as error:
        print("FAILED", error.culprit.rank, error.culprit.exc_type, error.victims)
    spark.stop()
"""


def test_connect_session(connect_server: str, tmp_path: Path) -> None:
    client = tmp_path / "client.py"
    client.write_text(CLIENT)
    done = subprocess.run(
        [sys.executable, str(client), connect_server],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT (0, 2.0)" in done.stdout
    assert "DATA 30 435" in done.stdout  # Spark wrote the rows; the ranks read them all
    assert "[rank 1 127.0.0.1] all_reduce gave 2.0" in done.stdout
    assert "FAILED 1 KeyError (0,)" in done.stdout or "FAILED 1 KeyError ()" in done.stdout
