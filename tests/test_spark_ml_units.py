"""The pure parts of Spark ML and inference, without a Spark session: outputs, tasks, devices."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

from sparktrain import ConfigError

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from sparktrain.inference.rank import outputs  # noqa: E402
from sparktrain.spark.rank import scoring, tasks  # noqa: E402
from sparktrain.spark.rank.scoring import Where, input_tensors  # noqa: E402


def test_output_specs_and_spark_types() -> None:
    rows = 3
    cases: list[tuple[Any, str]] = [
        (torch.zeros(rows), "float"),
        (torch.zeros(rows, 1, dtype=torch.float64), "double"),
        (torch.zeros(rows, 4), "array<float>"),
        (torch.zeros(rows, 2, 5, dtype=torch.int64), "array<array<bigint>>"),
        (torch.zeros(rows, dtype=torch.bool), "boolean"),
        (torch.zeros(rows, 2, dtype=torch.bfloat16), "array<float>"),
        ({"a": torch.zeros(rows), "b": torch.zeros(rows, 2)}, "struct<a:float,b:array<float>>"),
        ((torch.zeros(rows, dtype=torch.int32),), "struct<_0:int>"),
    ]
    for output, expected in cases:
        assert outputs.spark_type(outputs.describe(output, rows)).simpleString() == expected


def test_outputs_become_arrow_without_copying_rows() -> None:
    nested = torch.arange(12, dtype=torch.float32).reshape(2, 2, 3)
    spec = outputs.describe(nested, 2)
    array = outputs.to_arrow(nested, spec)
    assert array.type == outputs.arrow_type(spec)
    assert array.to_pylist() == nested.tolist()
    pair = {"p": torch.tensor([1.0, 2.0], dtype=torch.float64), "c": torch.tensor([[3], [4]])}
    spec = outputs.describe(pair, 2)
    assert outputs.to_arrow(pair, spec).to_pylist() == [{"p": 1.0, "c": 3}, {"p": 2.0, "c": 4}]
    half = torch.tensor([[0.5, 1.5]], dtype=torch.float16)
    assert outputs.to_arrow(half, outputs.describe(half, 1)).to_pylist() == [[0.5, 1.5]]


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (torch.zeros(2, 3), "returned 2 rows for a batch of 3"),
        (torch.tensor(1.0), "returned a single value"),
        ("text", "returned a str"),
        (torch.zeros(3, dtype=torch.complex64), "complex64 values, which Spark cannot hold"),
        ({}, "empty dict"),
    ],
)
def test_bad_outputs_are_named(output: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        outputs.describe(output, 3)


def test_a_later_batch_must_keep_the_first_batchs_shape() -> None:
    spec = outputs.describe(torch.zeros(2, 3), 2)
    with pytest.raises(ConfigError, match=r"shape \[4\] per row, but float32 of shape \[3\]"):
        outputs.to_arrow(torch.zeros(2, 4), spec)
    with pytest.raises(ConfigError, match="same structure"):
        outputs.to_arrow({"x": torch.zeros(2, 3)}, outputs.describe((torch.zeros(2, 3),), 2))


def test_tasks_follow_the_loss() -> None:
    assert tasks.resolve_task("auto", "cross_entropy") == "classification"
    assert tasks.resolve_task("auto", torch.nn.BCEWithLogitsLoss()) == "binary"
    assert tasks.resolve_task("auto", torch.nn.HuberLoss()) == "regression"
    assert tasks.resolve_task("auto", lambda o, y: (o - y).abs().mean()) == "raw"
    assert tasks.resolve_task("regression", "cross_entropy") == "regression"
    with pytest.raises(ConfigError, match="unknown task 'clasification'"):
        tasks.resolve_task("clasification", None)


def test_heads_give_sparks_classifier_columns() -> None:
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 3.0, 0.0]])
    added = tasks.head(logits, "classification", ("prediction", "raw", "probability"))
    assert added["prediction"].tolist() == [0.0, 1.0]
    assert torch.allclose(added["probability"].sum(dim=1), torch.ones(2))
    binary = tasks.head(
        torch.tensor([[-1.0], [2.0]]), "binary", ("prediction", "raw", "probability")
    )
    assert binary["prediction"].tolist() == [0.0, 1.0]
    assert binary["raw"].tolist() == [[1.0, -1.0], [-2.0, 2.0]]
    assert torch.allclose(binary["probability"][1], torch.tensor([1 - 0.8808, 0.8808]), atol=1e-4)
    with pytest.raises(ConfigError, match="one value per row"):
        tasks.head(torch.zeros(2, 3), "regression", ("prediction",))


def test_classification_labels_must_be_class_indices() -> None:
    output = torch.zeros(3, 4)
    assert (
        tasks.labels(
            torch.tensor([0.0, 3.0, 1.0], dtype=torch.float64), "classification", output, "y"
        ).dtype
        == torch.long
    )
    with pytest.raises(
        ConfigError, match=r"'y' holds 4.0, which is not a class index .* 4 outputs"
    ):
        tasks.labels(torch.tensor([0.0, 4.0, 1.0]), "classification", output, "y")
    with pytest.raises(ConfigError, match=r"holds 0\.5"):
        tasks.labels(torch.tensor([0.5, 1.0, 1.0]), "classification", output, "y")
    regression = tasks.labels(
        torch.tensor([1.0, 2.0], dtype=torch.float64), "regression", torch.zeros(2, 1), "y"
    )
    assert regression.shape == (2, 1) and regression.dtype == torch.float32


@pytest.mark.parametrize(
    ("address", "use_gpu", "cuda", "expected"),
    [
        (None, None, 0, "cpu"),
        ("1", None, 0, "cpu"),
        ("1", None, 2, "cuda:1"),
        ("0", True, 1, "cuda:0"),
        ("3", False, 4, "cpu"),
    ],
)
def test_the_device_comes_from_the_tasks_gpu(
    address: str | None, use_gpu: bool | None, cuda: int, expected: str
) -> None:
    assert scoring.device_for(address, use_gpu, cuda) == expected


def test_a_gpu_that_cannot_be_used_is_named() -> None:
    with pytest.raises(ConfigError, match=r"given no GPU: set spark\.task\.resource\.gpu"):
        scoring.device_for(None, True, 0)
    with pytest.raises(ConfigError, match="given GPU 1, but torch in the executor's Python sees"):
        scoring.device_for("1", True, 0)
    with pytest.raises(ConfigError, match="given GPU '2', but torch sees 2 device"):
        scoring.device_for("2", None, 2)


def test_input_columns_become_tensors_in_the_models_dtype() -> None:
    values = np.arange(6, dtype=np.float32)
    lists = pa.ListArray.from_arrays(pa.array([0, 3, 6], pa.int32()), pa.array(values))
    vectors = pa.StructArray.from_arrays(
        [
            pa.array([1, 0], pa.int8()),
            pa.array([None, 3], pa.int32()),
            pa.array([None, [2]], pa.list_(pa.int32())),
            pa.array([[1.0, 2.0, 3.0], [9.0]], pa.list_(pa.float64())),
        ],
        names=["type", "size", "indices", "values"],
    )
    ids = pa.array([5, 6], pa.int64())
    widths: list[int | None] = [None, None, None]
    got = input_tensors([lists, vectors, ids], ["a", "v", "i"], widths, Where(2), torch.float64)
    assert got[0].dtype == torch.float64 and got[0].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got[1].tolist() == [[1.0, 2.0, 3.0], [0.0, 0.0, 9.0]]
    assert got[2].dtype == torch.int64
    assert widths == [3, 3, None]
    uneven = pa.ListArray.from_arrays(pa.array([0, 3, 4], pa.int32()), pa.array(values[:4]))
    with pytest.raises(ConfigError, match=r"'a' has 1 values at row 11 of partition 2"):
        input_tensors([uneven], ["a"], [3], Where(2, offset=10), torch.float32)
    with pytest.raises(ConfigError, match="'s' holds string"):
        input_tensors([pa.array(["x"])], ["s"], [None], Where(0), torch.float32)


def test_metrics_match_their_definitions() -> None:
    from sparktrain.spark.rank.loop import metrics

    g = torch.Generator().manual_seed(0)
    score = torch.randn(200, generator=g)
    label = (score + torch.randn(200, generator=g) > 0).double()
    score[:20] = 0.0  # ties share their rank
    positive, negative = score[label == 1], score[label == 0]
    pairs = (positive[:, None] > negative[None, :]).double() + 0.5 * (
        positive[:, None] == negative[None, :]
    ).double()
    assert metrics.auc(score, label) == pytest.approx(float(pairs.mean()))
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0]])
    classes = torch.tensor([0.0, 1.0, 2.0, 2.0])
    assert metrics.accuracy(logits, classes) == 0.75
    # per class (tp, predicted, actual): 0 (1,1,1), 1 (1,2,1), 2 (1,1,2): macro F1 of 1, 2/3, 2/3
    assert metrics.f1(logits, classes) == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)
    assert metrics.r2(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0])) == 1.0
    assert metrics.rmse(torch.tensor([[1.0], [3.0]]), torch.tensor([0.0, 0.0])) == pytest.approx(
        5**0.5
    )


def test_metric_and_control_values_are_checked_with_the_fix() -> None:
    from sparktrain.spark.rank.loop import controls, metrics

    with pytest.raises(ConfigError, match="unknown metric 'acc'; choose from accuracy"):
        metrics.resolve(["acc"])
    with pytest.raises(ConfigError, match="needs a name"):
        metrics.resolve([lambda o, label: 0.0])
    assert [n for n, _ in metrics.resolve({"mine": lambda o, label: 0.0})] == ["mine"]
    assert controls.mode_of("val_accuracy", "auto") == "max"
    assert controls.mode_of("val_label_f1", "auto") == "max"
    assert controls.mode_of("val_loss", "auto") == "min"
    with pytest.raises(ConfigError, match="unknown lrSchedule 'cosin'"):
        controls.check_schedule("cosin")


def test_early_stopping_keeps_the_best_state_and_counts_patience() -> None:
    from sparktrain.spark.rank.loop.controls import EarlyStopping

    stopper = EarlyStopping("val_loss", "min", patience=2, min_delta=0.05)
    assert not stopper.update(0, {"val_loss": 1.0}, {"w": 0})
    assert not stopper.update(1, {"val_loss": 0.9}, {"w": 1})
    assert not stopper.update(2, {"val_loss": 0.87}, {"w": 2})  # not by more than min_delta
    assert stopper.update(3, {"val_loss": float("nan")}, {"w": 3})
    assert (stopper.best_epoch, stopper.best_state) == (1, {"w": 1})
    with pytest.raises(ConfigError, match="monitor='val_loss' is not among the epoch's metrics"):
        stopper.update(4, {"loss": 1.0}, {})


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"validation": 1.5}, "validation=1.5 must be a fraction between 0 and 1"),
        ({"metrics": ["nope"]}, "unknown metric 'nope'"),
        ({"labelCols": ["a", "b"], "lossWeights": [1.0]}, "lossWeights has 1 value"),
        ({"earlyStoppingPatience": -1}, "earlyStoppingPatience=-1 must be a whole number >= 0"),
        ({"monitorMode": "up"}, "monitorMode='up' must be one of auto, min, max"),
        ({"lrSchedule": "warm"}, "unknown lrSchedule 'warm'"),
        ({"backwardPassesPerStep": 0}, "backwardPassesPerStep=0 must be a positive"),
    ],
)
def test_bad_training_params_are_named_before_fit(given: dict[str, Any], message: str) -> None:
    from sparktrain.spark import TorchEstimator

    estimator = TorchEstimator(model=lambda: torch.nn.Linear(2, 1), loss="mse", **given)
    with pytest.raises(ConfigError, match=re.escape(message)):
        estimator.check_fit()


def test_the_task_param_decides_how_labels_of_a_custom_loss_are_read() -> None:
    from sparktrain.spark import TorchEstimator, fitdata

    def my_loss(output: Any, label: Any) -> Any:
        return torch.nn.functional.cross_entropy(output, label)

    estimator = TorchEstimator(model=lambda: torch.nn.Linear(2, 3), loss=my_loss)
    assert fitdata._tasks(estimator, (my_loss,)) == ("raw",)
    estimator.setTask("classification")
    assert fitdata._tasks(estimator, (my_loss,)) == ("classification",)
    assert fitdata._tasks(estimator, ("cross_entropy", "mse")) == ("classification", "regression")


def test_binary_and_multiclass_metrics_follow_the_output_not_the_rows_present() -> None:
    from sparktrain.spark.rank.loop import metrics

    three = torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 2.0, 0.0]])
    labels = torch.tensor([0.0, 1.0, 0.0])  # class 2 absent: still a macro mean, over 0 and 1
    assert metrics.f1(three, labels) == pytest.approx((2 / 3 + 2 / 3) / 2)
    with pytest.raises(ConfigError, match="auc needs a binary score"):
        metrics.auc(three, labels)
    assert metrics.compute(metrics.resolve(["f1"]), torch.empty(0, 3), torch.empty(0), "v_") == {
        "v_f1": pytest.approx(float("nan"), nan_ok=True)
    }
