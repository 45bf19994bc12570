"""Batch inference over files on Spark: ``predict``'s files path and ``score`` on executors.

The session fixture's real ``local-cluster`` runs every check; outputs are compared with the
model's own forward pass, matched by id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sparktrain import ConfigError

pytestmark = pytest.mark.spark
pytest.importorskip("pyspark")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from sparktrain.spark import predict  # noqa: E402
from test_inference import (  # noqa: E402
    WIDTH,
    make_model,
    scored_through_a_crash,
    write_features,
)


def _expected(data: Path, ids: list[int]) -> np.ndarray:
    source = pq.read_table(data).sort_by("id")
    x = torch.from_numpy(np.stack(source.column("x").to_numpy(zero_copy_only=False)))
    with torch.inference_mode():
        return make_model()(x).numpy()[ids]


def _rows(df: Any) -> tuple[list[int], np.ndarray]:
    rows = df.orderBy("id").collect()
    return [r.id for r in rows], np.array([r.prediction for r in rows], dtype=np.float32)


def test_a_plain_scan_is_read_in_the_workers(
    spark: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data = write_features(tmp_path / "in")
    df = spark.read.parquet(str(data))
    scored = predict(df, make_model(), input_cols="x", keep_cols="id")
    assert "the files path (the DataFrame is a plain scan" in capfd.readouterr().err
    assert scored.columns == ["id", "prediction"]
    ids, got = _rows(scored)
    assert ids == list(range(6000))
    np.testing.assert_allclose(got, _expected(data, ids), rtol=1e-5, atol=1e-5)
    filtered = predict(df.where("id >= 10 and id < 4010").select("x", "id"), make_model(),
                       input_cols="x")  # fmt: skip
    assert "rows where" in capfd.readouterr().err
    assert filtered.columns == ["x", "id", "prediction"]
    ids, got = _rows(filtered)
    assert ids == list(range(10, 4010))
    np.testing.assert_allclose(got, _expected(data, ids), rtol=1e-5, atol=1e-5)
    written = tmp_path / "written"
    scored.write.parquet(str(written))  # a lazy DataFrame: Spark's writer works as usual
    assert pq.read_table(written).num_rows == 6000


def test_a_path_is_scored_as_a_dataframe(spark: Any, tmp_path: Path) -> None:
    data = write_features(tmp_path / "in", files=1)
    ids, got = _rows(predict(str(data), make_model(), input_cols="x", keep_cols=["id"]))
    assert ids == list(range(2000))
    np.testing.assert_allclose(got, _expected(data, ids), rtol=1e-5, atol=1e-5)
    # The fixture gives each task a (fake) GPU; torch in the executors has no CUDA.
    on_gpu = predict(str(data), make_model(), input_cols="x", use_gpu=True)
    with pytest.raises(Exception, match=r"given GPU [01], but torch in the executor's Python"):
        on_gpu.collect()


def test_a_dataframe_that_is_not_a_scan_takes_the_udf_path(
    spark: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data = write_features(tmp_path / "in", files=1)
    df = spark.read.parquet(str(data))
    joined = df.join(spark.range(0, 2000, 2).withColumnRenamed("id", "id"), "id")
    ids, got = _rows(predict(joined, make_model(), input_cols="x", keep_cols="id"))
    err = capfd.readouterr().err
    assert "the UDF path" in err and "its plan has a Join step" in err
    assert ids == list(range(0, 2000, 2))
    np.testing.assert_allclose(got, _expected(data, ids), rtol=1e-5, atol=1e-5)
    computed = df.withColumn("x", F.transform("x", lambda v: v * 2))
    predict(computed, make_model(), input_cols="x").count()
    assert "it computes" in capfd.readouterr().err
    with pytest.raises(ConfigError, match="via='files', but the DataFrame is not a plain scan"):
        predict(joined, make_model(), input_cols="x", via="files")


def test_bad_rows_on_the_files_path_name_the_file_and_row(spark: Any, tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    values = [[0.5] * WIDTH] * 700
    values[433] = None
    pq.write_table(pa.table({"id": np.arange(700), "x": pa.array(values, pa.list_(pa.float32()))}),
                   folder / "nulls.parquet", row_group_size=300)  # fmt: skip
    scored = predict(spark.read.parquet(str(folder)), make_model(), input_cols="x")
    with pytest.raises(Exception, match=r"column 'x' is null at row 433 of .*nulls\.parquet"):
        scored.collect()


def test_score_on_spark_executors_restarts_and_skips_written_parts(
    spark: Any, tmp_path: Path
) -> None:
    scored_through_a_crash(tmp_path, backend="spark")


def test_ml_vectors_are_read_on_the_files_path_and_kept_on_the_udf_path(
    spark: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from pyspark.ml.functions import array_to_vector

    data = write_features(tmp_path / "in", files=1)
    vectors = tmp_path / "vectors"
    spark.read.parquet(str(data)).select("id", array_to_vector("x").alias("v")).write.parquet(
        str(vectors)
    )
    df = spark.read.parquet(str(vectors))
    ids, got = _rows(predict(df, make_model(), input_cols="v", keep_cols="id"))
    assert "the files path" in capfd.readouterr().err
    np.testing.assert_allclose(got, _expected(data, ids), rtol=1e-5, atol=1e-4)
    kept = predict(df, make_model(), input_cols="v")
    assert "keeps 'v', an ML vector" in capfd.readouterr().err
    assert kept.schema["v"].dataType.typeName() == "vectorudt"


def test_filters_keep_the_rows_spark_keeps(
    spark: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """NOT IN drops nulls, as in Spark; a float comparison (NaN) and a partitioned table."""
    rows = 600
    values = [[float(i)] * WIDTH for i in range(rows)]
    table = pa.table(
        {
            "id": np.arange(rows),
            "x": pa.array(values, pa.list_(pa.float32())),
            "country": [None if i % 5 == 0 else ("US", "CA", "FR")[i % 3] for i in range(rows)],
            "score": [float("nan") if i % 7 == 0 else i / rows for i in range(rows)],
            "year": [2023 + i % 2 for i in range(rows)],
        }
    )
    flat = tmp_path / "flat"
    flat.mkdir()
    pq.write_table(table, flat / "t.parquet", row_group_size=100)
    df = spark.read.parquet(str(flat))
    model = make_model()
    for condition in (~F.col("country").isin("US", "CA"), F.col("id").isin(3, 4, 500)):
        ids, _ = _rows(predict(df.where(condition), model, input_cols="x", keep_cols="id"))
        assert "the files path" in capfd.readouterr().err
        assert ids == sorted(r.id for r in df.where(condition).select("id").collect())
    ids, _ = _rows(predict(df.where(F.col("score") > 0.5), model, input_cols="x", keep_cols="id"))
    assert "where Spark and pyarrow treat NaN differently" in capfd.readouterr().err
    assert ids == sorted(r.id for r in df.where(F.col("score") > 0.5).select("id").collect())
    parted = tmp_path / "parted"
    df.write.partitionBy("year").parquet(str(parted))
    by_year = spark.read.parquet(str(parted)).where("year = 2024 and id < 50")
    scored = predict(by_year, model, input_cols="x", keep_cols=["id", "year"])
    assert "the files path" in capfd.readouterr().err
    assert {(r.id, r.year) for r in scored.collect()} == {(i, 2024) for i in range(1, 50, 2)}
    # The driver's sample comes from rows that pass the filter (row 0 has a null country).
    predict(df.where(F.col("country").isNotNull()), model, input_cols="x").count()
