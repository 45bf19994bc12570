"""Ray on Spark: a Ray cluster on the Spark fixture's executors, with Ray's token authentication
on; a 2-rank run on it; clients without the token refused; then nothing left running."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest

from conftest import alive
from sparktrain import launch

pytestmark = pytest.mark.spark

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers lack tests/


def _rank_world_pid() -> tuple[int, int, int]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), int(t.item()), os.getpid()


CLIENT = """
import sys
import ray
try:
    ray.init(address=sys.argv[1])
except Exception as error:
    print("REFUSED", type(error).__name__)
else:
    print("CONNECTED", ray.cluster_resources().get("CPU"))
    ray.shutdown()
"""


def _client(address: str, home: Path, **variables: str) -> str:
    """A separate process's ray.init(address) with only ``variables`` of Ray's auth settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_NUM_REDIS_GET_RETRIES="2", **variables)  # fail fast
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, address],
        capture_output=True, text=True, timeout=180, env=env, check=False,
    )  # fmt: skip
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]


def test_two_ranks_on_ray_on_spark_with_token_auth_then_nothing_left(
    spark: object, tmp_path: Path
) -> None:
    pytest.importorskip("ray.util.spark")
    import ray

    from sparktrain.ray import setup_on_spark

    # The fixture's executors have fake GPUs; this CPU cluster asks Ray for none.
    with setup_on_spark(max_worker_nodes=2, num_cpus_worker_node=1, num_gpus_worker_node=0) as c:
        assert ray.is_initialized()
        result = launch(_rank_world_pid, num_processes=2, use_gpu=False, backend="ray")
        running = {pid for pid, _ in c.processes()}
        token = Path(c.token_path or "")
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
        home = tmp_path / "home"  # no ~/.ray/auth_token there
        home.mkdir()
        assert _client(c.address, home, RAY_AUTH_MODE="disabled") == "REFUSED ConnectionError"
        wrong = _client(c.address, home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64)
        assert wrong.startswith("REFUSED")
        right = _client(c.address, home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
        assert right.startswith("CONNECTED")
    assert result.value[:2] == (0, 2)
    assert [node.ranks for node in result.nodes] == [(0,), (1,)]  # two Ray worker nodes
    assert len(running) > 5  # head, two worker nodes, their raylets and agents
    assert not ray.is_initialized()
    assert [pid for pid in running | {result.value[2]} if alive(pid)] == []
    assert "RAY_ADDRESS" not in os.environ and "RAY_AUTH_TOKEN_PATH" not in os.environ
    assert not token.exists()  # the token is gone with the cluster


def test_the_auth_choice_and_the_token_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Token by default; auth='disabled' or RAY_AUTH_MODE=disabled opts out; the token reaches
    the worker nodes only through the start hook's variables, and this process by its file."""
    pytest.importorskip("ray")
    from sparktrain import ConfigError
    from sparktrain.ray import on_spark

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert on_spark._auth_mode(None) == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "DISABLED")
    assert on_spark._auth_mode(None) == "disabled"
    assert on_spark._auth_mode("token") == "token"
    with pytest.raises(ConfigError, match="auth='off' must be 'token'"):
        on_spark._auth_mode("off")
    driver, workers, path = on_spark._environment("token")
    assert path is not None and Path(path).read_text() == workers["RAY_AUTH_TOKEN"]
    assert len(workers["RAY_AUTH_TOKEN"]) == 64 and "RAY_AUTH_TOKEN" not in driver
    assert driver["RAY_AUTH_TOKEN_PATH"] == path and driver["RAY_AUTH_MODE"] == "token"
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    Path(path).unlink()
    Path(path).parent.rmdir()
    driver, workers, path = on_spark._environment("disabled")
    assert path is None and driver["RAY_AUTH_MODE"] == workers["RAY_AUTH_MODE"] == "disabled"
