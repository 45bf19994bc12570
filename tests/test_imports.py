"""``import sparktrain`` is cheap and imports no optional engine; the public surface is frozen."""

from __future__ import annotations

import subprocess
import sys

import sparktrain

HEAVY = ("torch", "pyspark", "ray", "mlflow", "deepspeed", "tensorflow", "cloudpickle")


def test_import_pulls_in_nothing_heavy() -> None:
    code = f"import sys, sparktrain; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_names() -> None:
    assert sorted(sparktrain.__all__) == [
        "CapacityError",
        "CheckpointError",
        "ClusterConfigError",
        "ClusterError",
        "ConfigError",
        "DeepspeedTorchDistributor",
        "HangError",
        "HorovodRunner",
        "LaunchPlan",
        "LocalCluster",
        "MirroredStrategyRunner",
        "RankFailure",
        "Rescale",
        "RunOptions",
        "RunResult",
        "SparkJobError",
        "TorchDistributor",
        "TrainingFailedError",
        "TrainingTimeoutError",
        "__version__",
        "backward",
        "checkpoint",
        "deepspeed_config",
        "distributed",
        "elastic",
        "forward_backward",
        "full_state_dict",
        "launch",
        "log_metrics",
        "log_model",
        "log_params",
        "plan",
        "preempt",
        "prepare_data_loader",
        "prepare_model",
        "prepare_optimizer",
        "progress",
        "report",
        "restart_count",
        "shutdown_warm",
        "tune",
        "tuning",
    ]
    for name in sparktrain.__all__:
        assert getattr(sparktrain, name) is not None
    assert issubclass(sparktrain.TrainingFailedError, RuntimeError)
    assert issubclass(sparktrain.ConfigError, ValueError)
    assert sparktrain.SparkJobError is sparktrain.ClusterError  # the old name, kept


def test_unknown_attribute() -> None:
    try:
        sparktrain.TorchDistributer  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "TorchDistributer" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_the_spark_ml_package_loads_pyspark_only_when_used() -> None:
    code = "import sys, sparktrain.spark as s; print('pyspark' in sys.modules, sorted(s.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False ['FitContext', 'TorchEstimator', 'TorchModel', 'predict']"


def test_the_spark_ml_package_without_pyspark_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['pyspark'] = None\n"
        "from sparktrain import ConfigError\n"
        "try:\n"
        "    from sparktrain.spark import TorchEstimator\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (
        "sparktrain.spark.TorchEstimator needs pyspark: pip install 'sparktrain[spark]'"
    )


def test_a_public_name_is_declared_in_one_table() -> None:
    """``__all__`` is made from ``_LAZY`` (and the errors); the ``TYPE_CHECKING`` imports, there
    for type checkers, re-export exactly the table's names."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(sparktrain.__file__).read_text())
    typing_block = next(
        n
        for n in tree.body
        if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"
    )
    typed = {
        alias.asname or alias.name
        for node in ast.walk(typing_block)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == set(sparktrain._LAZY)
    assert set(sparktrain.__all__) == {*sparktrain._LAZY, *sparktrain._ERRORS, "__version__"}
    for name, (module, attribute) in sparktrain._LAZY.items():
        target = __import__("importlib").import_module(
            f"sparktrain.{attribute}" if module == "sparktrain" else module
        )
        assert module == "sparktrain" or hasattr(target, attribute), name


def test_every_front_door_documents_every_run_option() -> None:
    """The docstrings list the options from RunOptions' fields, so none is ever missing."""
    from sparktrain.horovod.runner import run as horovod_run
    from sparktrain.inference import score
    from sparktrain.launchplan.option_docs import OPTIONS_MARK
    from sparktrain.launchplan.options import NAMES

    doors = [
        sparktrain.launch,
        sparktrain.distributed,
        sparktrain.TorchDistributor.__init__,
        sparktrain.DeepspeedTorchDistributor.__init__,
        sparktrain.HorovodRunner.__init__,
        sparktrain.MirroredStrategyRunner.__init__,
        horovod_run,
        sparktrain.tune,
        score,
    ]
    for door in doors:
        doc = door.__doc__ or ""
        assert OPTIONS_MARK not in doc, door
        missing = [n for n in NAMES if f"``{n}``" not in doc]
        assert not missing, (door.__qualname__, missing)


def test_a_users_subclass_of_a_front_door_is_left_as_it_is() -> None:
    class Mine(sparktrain.TorchDistributor):
        def __init__(self) -> None:
            """My own distributor."""
            super().__init__(1)

    assert Mine.__init__.__doc__ == "My own distributor."
    assert Mine().num_processes == 1


def test_the_keyword_type_names_every_option_of_every_group() -> None:
    """``RunOptionsArgs`` (the front doors' ``**options``) is the groups' fields, name for name
    and type for type: a new option cannot be left out of it."""
    import dataclasses

    from sparktrain.launchplan.options import GROUPS, NAMES, RunOptions, RunOptionsArgs

    assert tuple(RunOptionsArgs.__annotations__) == NAMES
    widened = {"log_ranks": "Collection[int] | None"}  # any collection in, a frozen set kept
    for group in GROUPS.values():
        for item in dataclasses.fields(group):
            wanted = widened.get(item.name, item.type)
            typed = RunOptionsArgs.__annotations__[item.name]
            assert getattr(typed, "__forward_arg__", typed) == wanted, item.name
    assert [f.name for f in dataclasses.fields(RunOptions)] == list(GROUPS)
