"""Score Parquet files with a PyTorch model, on this machine, without Spark: resumable output.

    python examples/score_files.py

Writes 60,000 rows of 784 float32 features, scores them with the seeds' MLP on 2 ranks that
read the files themselves, and writes one Parquet file per part. Run it twice: the second run
finds every part written and scores nothing. With Spark, the same call runs on the executors
(``backend="spark", num_processes=...``), and ``sparktrain.spark.predict`` returns the
predictions as a DataFrame (docs/spark-ml.md, "Inference at scale").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_mlp import make_model

from sparktrain.inference import ScoreResult, score


def write_features(folder: Path, rows: int = 60_000, files: int = 3) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_file = rows // files
    for index in range(files):
        values = rng.standard_normal(per_file * 784, dtype=np.float32)
        offsets = pa.array(np.arange(0, per_file * 784 + 1, 784, dtype=np.int32))
        table = pa.table(
            {
                "id": pa.array(np.arange(index * per_file, (index + 1) * per_file)),
                "features": pa.ListArray.from_arrays(offsets, pa.array(values)),
            }
        )
        pq.write_table(table, folder / f"part-{index}.parquet", row_group_size=5_000)


def main(argv: list[str] | None = None) -> ScoreResult:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "sparktrain-score"))
    args = parser.parse_args(argv)
    work = Path(args.work)
    if not (work / "features").exists():
        write_features(work / "features", rows=args.rows)
    torch.manual_seed(0)
    model = make_model().eval()
    result = score(
        work / "features",
        model,
        output=work / "scores",
        input_cols="features",
        keep_cols=["id"],
        rows_per_part=10_000,
        num_processes=2,
    )
    print(
        f"{result.rows:,} rows in {result.parts} parts at {result.output}; "
        f"{result.scored_parts} part(s) scored by this run in {result.seconds:.1f}s"
    )
    first = pq.read_table(result.output).sort_by("id").slice(0, 3)
    for row in first.to_pylist():
        print(f"id {row['id']}: class {int(np.argmax(row['prediction']))}")
    return result


if __name__ == "__main__":
    main()
