"""``@sparktrain.distributed``: the function stays itself; ``fn.distributed`` runs every rank."""

from __future__ import annotations

import os
import sys

import cloudpickle
import pytest

import sparktrain
from sparktrain import ConfigError, TrainingFailedError

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import tests/


@sparktrain.distributed(num_processes=2, use_gpu=False)
def rank_and_scale(scale: int, *, offset: int = 0) -> tuple[int, int]:
    """A rank's number, scaled; the world size."""
    import torch.distributed as dist

    if not dist.is_initialized() and "RANK" not in os.environ:
        return (0, 1)  # called as itself, outside a launch
    dist.init_process_group("gloo")
    return (dist.get_rank() * scale + offset, dist.get_world_size())


def test_the_function_stays_itself_and_runs_on_every_rank() -> None:
    assert rank_and_scale(10) == (0, 1)
    assert rank_and_scale.__name__ == "rank_and_scale"
    assert rank_and_scale.__doc__ == "A rank's number, scaled; the world size."
    assert rank_and_scale.distributed(10, offset=1) == [(1, 2), (11, 2)]
    assert "2 ranks" in repr(rank_and_scale)


def _fails_on_rank_one() -> int:
    if os.environ["RANK"] == "1":
        raise KeyError("no such feature")
    return 0


def test_a_failing_rank_is_named() -> None:
    bare = sparktrain.distributed(_fails_on_rank_one)  # bare: one rank, which succeeds
    assert bare.distributed() == [0]
    two = sparktrain.distributed(num_processes=2, use_gpu=False)(_fails_on_rank_one)
    with pytest.raises(TrainingFailedError, match="rank 1") as raised:
        two.distributed()
    assert raised.value.culprit is not None and raised.value.culprit.exc_type == "KeyError"


@pytest.mark.spark
def test_on_spark_every_ranks_value_in_rank_order(spark: object) -> None:
    on_spark = sparktrain.distributed(num_processes=2, use_gpu=False, backend="spark")
    assert on_spark(_environment_rank).distributed() == [0, 1]


def _environment_rank() -> int:
    return int(os.environ["RANK"])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"num_processes": 0}, "num_processes=0 must be at least 1"),
        ({"num_processes": "2"}, r"num_processes='2' \(str\) is not an int"),
        ({"use_gpu": "yes"}, "use_gpu='yes' must be True, False, or None"),
        ({"backend": "sprak"}, "backend='sprak' is not one of: local, ray, spark"),
        ({"timout": 5}, r"unknown option 'timout' \(did you mean 'timeout'\?\)"),
        ({"timeout": -1}, "timeout=-1 must be a positive number of seconds"),
        ({"gpus": 8}, "gpus= is the Serverless GPU API's argument.*num_processes=N, use_gpu=True"),
        ({"remote": True}, r"remote= .*backend='spark'"),
        ({"return_all": False}, "return_all= does not apply"),
    ],
)
def test_bad_arguments_fail_at_decoration(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        sparktrain.distributed(**arguments)  # type: ignore[call-overload]


def test_decorating_something_else_is_refused() -> None:
    with pytest.raises(ConfigError, match="decorates a function, not 42"):
        sparktrain.distributed(num_processes=2)(42)  # type: ignore[arg-type]
