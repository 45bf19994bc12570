"""The backends' registry, and a new backend added as one folder and one registry line.

``tests/skeleton_backend/`` is the least a backend is (a driver side and a node side); registered
here with one line, it runs a real 2-rank launch: processes that form a gloo group, a value back
from every rank, a failure that names rank 1, nothing left running.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import cloudpickle
import pytest

import sparktrain
from sparktrain import ConfigError, TorchDistributor, TrainingFailedError, launch
from sparktrain.backends import registry
from sparktrain.backends.registry import BackendName

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SRC = Path(sparktrain.__file__).parent


@pytest.fixture
def skeleton() -> Iterator[str]:
    """The skeleton backend, registered by its one line for the test."""
    registry.register("skeleton", "skeleton_backend.backend:SkeletonBackend")
    try:
        yield "skeleton"
    finally:
        registry.unregister("skeleton")


def _sum_of_ranks() -> tuple[int, int, float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), float(total.item())


def _fails_on_rank_one() -> None:
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("bad batch on rank 1")


def test_a_skeleton_backend_runs_a_two_rank_launch(skeleton: str) -> None:
    result = launch(_sum_of_ranks, num_processes=2, backend=skeleton, return_all=True)  # type: ignore[arg-type]
    assert result.return_values == {0: (0, 2, 3.0), 1: (1, 2, 3.0)}
    with pytest.raises(TrainingFailedError, match="rank 1") as caught:
        launch(_fails_on_rank_one, num_processes=2, backend=skeleton)  # type: ignore[arg-type]
    assert "bad batch on rank 1" in str(caught.value)


def test_a_front_door_asks_the_skeleton_what_it_is(skeleton: str) -> None:
    """TorchDistributor's num_tasks is the backend's answer (a task per node here), not a rule
    about the name."""
    distributor = TorchDistributor(2, backend=skeleton)  # type: ignore[arg-type]
    assert distributor.input_params["num_tasks"] == 2
    assert distributor.run(_sum_of_ranks) == (0, 2, 3.0)


def test_the_registry_is_the_only_source_of_the_names() -> None:
    assert get_args(BackendName) == ("local", "spark", "ray")
    assert set(get_args(BackendName)) <= set(registry.BACKENDS)
    assert registry.names() == tuple(sorted(registry.BACKENDS))


def test_an_unknown_backend_is_refused_with_the_names_and_the_closest() -> None:
    with pytest.raises(ConfigError, match=r"'sprak' is not one of: local, ray, spark .*'spark'\?"):
        registry.make_backend("sprak")
    with pytest.raises(ConfigError, match="taken"):
        registry.register("local", "x:Y")
    with pytest.raises(ConfigError, match="'module:Class'"):
        registry.register("mine", "no_class_named")
    with pytest.raises(ConfigError, match="stay registered"):
        registry.unregister("spark")


def test_naming_a_backend_imports_nothing_until_it_is_made() -> None:
    """The registry is the only place that imports a backend, and only the one a launch names."""
    code = (
        "import json, sys\n"
        "from sparktrain.backends import registry\n"
        "before = sorted(m for m in sys.modules if m.startswith('sparktrain.backends.'))\n"
        "registry.backend_class('local')\n"
        "after = sorted(m for m in sys.modules if m.startswith('sparktrain.backends.'))\n"
        "print(json.dumps([before, after]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = json.loads(out.stdout)
    assert before == ["sparktrain.backends.base", "sparktrain.backends.registry"]
    assert not [
        m for m in after if m.startswith(("sparktrain.backends.spark", "sparktrain.backends.ray"))
    ]
    assert "sparktrain.backends.local.backend" in after


def test_only_the_registry_imports_a_wing() -> None:
    """No module outside a wing imports a wing's backend module: they all go through the
    registry (a front door may use a wing's helpers, such as the Spark session it shares)."""
    wings = ("local", "local_cluster", "spark", "ray")
    found = []
    for path in SRC.rglob("*.py"):
        relative = path.relative_to(SRC).as_posix()
        if relative.startswith("backends/"):
            continue
        for wing in wings:
            if f"sparktrain.backends.{wing}.backend import" in path.read_text():
                found.append(f"{relative} imports the {wing} wing's backend")
    assert not found, found


def test_no_front_door_branches_on_a_backend_name() -> None:
    """A front door asks the backend object (its class: on_this_machine, multi_node, ...); a
    comparison of ``backend`` with a name would put a backend's behaviour in the front door."""
    names = "|".join(get_args(BackendName))
    compares = r"(backend|where|\.name)\s*(==|!=|\bin\b|\bnot in\b)\s*\(?\s*(None,\s*)?"
    pattern = re.compile(compares + rf"""["']({names})["']""")
    doors = [*SRC.glob("*.py"), *SRC.glob("compat/*.py"), *SRC.glob("horovod/*.py")]
    doors += [*SRC.glob("inference/*.py"), *SRC.glob("spark/*.py"), *SRC.glob("tuning/*.py")]
    found = [f"{p.name}: {m.group(0)}" for p in doors for m in pattern.finditer(p.read_text())]
    assert not found, found
    assert pattern.search('if backend == "local":') and pattern.search("where != 'spark'")


def _horovod_run_in_a_rank() -> str:
    import horovod

    try:
        horovod.run(print, np=1)
    except ConfigError as refused:
        return str(refused)
    return "ran"


def test_horovod_run_belongs_to_the_caller_and_a_rank_says_so() -> None:
    """In a rank, ``horovod`` is the rank's own package: no front door is loaded there, and its
    run says where to call it. On the driver, install() gives the front door."""
    said = launch(_horovod_run_in_a_rank, num_processes=1).value
    assert "starts ranks from the caller's process" in said
    code = (
        "import sys, sparktrain.horovod\n"
        "sparktrain.horovod.install(quiet=True)\n"
        "import horovod, horovod.torch\n"
        "from sparktrain.horovod.runner import run\n"
        "print(horovod.run is run, horovod.torch.__name__,"
        " 'sparktrain.horovod.runner' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "sparktrain.horovod.torch", "True"]


def _loaded_front_doors() -> list[Any]:
    import sys

    import horovod.torch  # noqa: F401 - the alias, as a Horovod script imports it

    return sorted(
        m for m in sys.modules if m.startswith(("sparktrain.horovod.runner", "sparktrain.compat."))
    )


def test_a_rank_that_imports_horovod_loads_no_front_door() -> None:
    assert launch(_loaded_front_doors, num_processes=1).value == []


def test_a_wing_imports_no_other_wing() -> None:
    """Each backend's folder stands alone: what two wings share lives in backends/ itself."""
    from roles import imports

    wings = sorted(p.name for p in (SRC / "backends").iterdir() if (p / "__init__.py").exists())
    assert wings == ["local", "local_cluster", "ray", "spark"]
    found = [
        f"{path.relative_to(SRC)} imports {i.name}"
        for wing in wings
        for path in (SRC / "backends" / wing).rglob("*.py")
        for i in imports(path)
        for other in wings
        if other != wing and i.name.startswith(f"sparktrain.backends.{other}.")
    ]
    assert not found, found
