"""Real multi-process runs on this machine (gloo): results, logs, failures, cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import wait_gone
from sparktrain import (
    ConfigError,
    TorchDistributor,
    TrainingFailedError,
    TrainingTimeoutError,
    launch,
)
from sparktrain.launchplan.topology import Topology


def _all_reduce_rank() -> tuple[int, float, int]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), float(t), os.getpid()


def test_rank_zero_value_and_every_rank_value() -> None:
    assert TorchDistributor(2, True, False).run(_all_reduce_rank)[:2] == (0, 3.0)
    result = launch(_all_reduce_rank, num_processes=2, use_gpu=False, return_all=True)
    assert {r: v[:2] for r, v in result.return_values.items()} == {0: (0, 3.0), 1: (1, 3.0)}
    assert wait_gone([v[2] for v in result.return_values.values()]) == []


def _tagged_train(epochs: int) -> torch.nn.Module:
    from train_mlp import train_fn

    model = train_fn(epochs=epochs)
    model.module.trained_on_rank = int(os.environ["RANK"])
    return model


def test_seed_ddp_example(examples_on_path: Path) -> None:
    from train_mlp import make_dataset, make_model, mean_loss

    result = launch(_tagged_train, (3,), num_processes=2, use_gpu=False, return_all=True)
    models = result.return_values
    assert type(models[0]) is torch.nn.Sequential  # unwrapped from DDP
    assert models[0].trained_on_rank == 0 and models[1].trained_on_rank == 1
    for p0, p1 in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p0, p1)  # DDP kept the ranks in sync
    data = make_dataset()
    before, after = mean_loss(make_model(), data), mean_loss(models[0], data)
    assert after < 0.5 * before


def test_distributor_returns_rank_zeros_model(examples_on_path: Path) -> None:
    model = TorchDistributor(2, True, False).run(_tagged_train, 1)
    assert model.trained_on_rank == 0


def _fail_on_rank_one(pid_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sleeper = subprocess.Popen(["sleep", "60"])
    Path(pid_dir, f"{rank}.pids").write_text(f"{os.getpid()} {sleeper.pid}")
    dist.barrier()
    if rank == 1:
        raise ValueError("bad batch on rank 1")
    dist.barrier()  # rank 0 waits here for a peer that is gone


def test_failure_names_rank_traceback_and_victims(tmp_path: Path) -> None:
    with pytest.raises(TrainingFailedError) as info:
        launch(_fail_on_rank_one, (str(tmp_path),), num_processes=2, use_gpu=False)
    error = info.value
    assert error.culprit is not None and error.culprit.rank == 1
    assert error.victims == (0,)
    message = str(error)
    assert message.startswith("rank 1 on ")
    assert "ValueError: bad batch on rank 1" in message
    assert "in _fail_on_rank_one" in message and 'raise ValueError("bad batch' in message
    pids = [int(p) for f in tmp_path.glob("*.pids") for p in f.read_text().split()]
    assert len(pids) == 4
    assert wait_gone(pids, within=1.0) == []  # ranks and what they started: gone on return


def _sigkill_rank_one() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_rank_killed_by_signal_is_named() -> None:
    with pytest.raises(TrainingFailedError) as info:
        launch(_sigkill_rank_one, num_processes=2, use_gpu=False)
    culprit = info.value.culprit
    assert culprit is not None and culprit.rank == 1
    assert culprit.signal_name == "SIGKILL" and culprit.exit_code == -9
    assert "rank 1 on" in str(info.value) and "killed by SIGKILL" in str(info.value)


def _sleep_on_rank_one() -> int:
    if os.environ["RANK"] == "1":
        time.sleep(60)
    return os.getpid()


def test_timeout_names_running_ranks() -> None:
    """Rank 0 ends at once, rank 1 sleeps past the timeout: the error names rank 1 alone (the
    bound, counted from the call, leaves rank 0 room to start, the fork server too, and end on
    a loaded machine)."""
    with pytest.raises(TrainingTimeoutError) as info:
        launch(_sleep_on_rank_one, num_processes=2, use_gpu=False, timeout=20)
    assert info.value.running == (1,)
    assert "timeout=20s" in str(info.value) and "rank 1" in str(info.value)


def _fail_after_four_seconds_then_take_five() -> str:
    import sparktrain

    if sparktrain.restart_count() == 0:
        time.sleep(4)
        if os.environ["RANK"] == "1":
            raise RuntimeError("the first attempt fails")
        time.sleep(60)
    time.sleep(5)
    return "late"


def test_timeout_bounds_the_whole_call_not_each_attempt() -> None:
    """The first attempt fails after 4 s; the restart takes 5 s more, which fits in its own
    8 s but not in what is left of the call's: the call times out (it returned "late" when each
    attempt's nodes counted the timeout from their own start)."""
    with pytest.raises(TrainingTimeoutError) as info:
        launch(_fail_after_four_seconds_then_take_five, num_processes=2, use_gpu=False,
               timeout=8, max_restarts=1)  # fmt: skip
    assert info.value.running == (0, 1) and "timeout=8s" in str(info.value)


def test_script_with_args(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    out = tmp_path / "out"
    script.write_text(
        "import os, sys\n"
        "if __name__ == '__main__':\n"
        f"    open(os.path.join({str(out)!r}, os.environ['RANK']), 'w').write(' '.join(sys.argv))\n"
    )
    out.mkdir()
    assert TorchDistributor(2, True, False).run(str(script), "--lr", 0.5) is None
    for rank in ("0", "1"):
        assert (out / rank).read_text() == f"{script} --lr 0.5"


def test_failing_script_raises(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise KeyError('missing')\n")
    with pytest.raises(TrainingFailedError, match=r"rank 1 on .*KeyError: 'missing'") as info:
        TorchDistributor(2, True, False).run(str(script))
    assert "bad.py" in str(info.value)
    exits = tmp_path / "exit.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(TrainingFailedError, match="exited with code 3"):
        launch(str(exits), num_processes=1, use_gpu=False)


def test_two_concurrent_runs() -> None:
    results: dict[int, object] = {}

    def one(i: int) -> None:
        results[i] = launch(_all_reduce_rank, num_processes=2, use_gpu=False).value

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results[i][:2] for i in range(2)] == [(0, 3.0), (0, 3.0)]  # type: ignore[index]


def _print_many(n: int) -> None:
    rank = os.environ["RANK"]
    for i in range(n):
        print(f"line {rank} {i}")


def test_no_line_lost(capfd: pytest.CaptureFixture[str]) -> None:
    n = 100_000
    launch(_print_many, (n,), num_processes=2, use_gpu=False)
    lines = capfd.readouterr().out.splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[rank {rank}] ")]
        assert mine == [f"[rank {rank}] line {rank} {i}" for i in range(n)]


def _say_hello() -> None:
    print("hello from", os.environ["RANK"])
    print("to stderr", file=sys.stderr)


def test_log_filter(capfd: pytest.CaptureFixture[str]) -> None:
    TorchDistributor(2, True, False, log_ranks=[1]).run(_say_hello)
    out, err = capfd.readouterr()
    assert "[rank 1] hello from 1" in out and "[rank 0]" not in out
    assert "[rank 1] to stderr" in err


def test_logs_arrive_live(tmp_path: Path) -> None:
    """A line printed by a rank reaches the caller while the rank is still running."""
    caller = tmp_path / "caller.py"
    caller.write_text(
        "import time\n"
        "from sparktrain import launch\n"
        "def fn():\n"
        "    print('first', time.time(), flush=False)\n"
        "    time.sleep(4)\n"
        "if __name__ == '__main__':\n"
        "    launch(fn, num_processes=1, use_gpu=False)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(caller)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    seen = time.time()
    printed = float(line.split()[-1])
    assert line.startswith("[rank 0] first ")
    assert seen - printed < 1.0
    assert proc.wait(30) == 0


def _closure_factory(base: int):  # type: ignore[no-untyped-def]
    def train() -> int:
        return base + int(os.environ["RANK"])

    return train


def test_lambdas_and_closures() -> None:
    assert launch(lambda: 41 + 1, num_processes=1, use_gpu=False).value == 42
    assert launch(_closure_factory(10), num_processes=2, use_gpu=False).value == 10


def test_caller_cwd_and_sys_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "helper_mod_xyz.py").write_text("VALUE = 'found'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))

    def uses_module() -> tuple[str, str]:
        import helper_mod_xyz  # type: ignore[import-not-found]

        return helper_mod_xyz.VALUE, os.getcwd()

    assert launch(uses_module, num_processes=1, use_gpu=False).value == ("found", str(tmp_path))


def _environment() -> dict[str, str]:
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR")
    env = {k: os.environ[k] for k in keys}
    env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    return env


def test_gpu_ranks_see_their_gpus() -> None:
    """GPU assignment with faked discovery: the real plan -> env -> rank path, no CUDA call."""
    fake = Topology(cpus=2, gpus=("3", "5", "6"), hostname="h")
    result = launch(_environment, num_processes=2, use_gpu=True, topology=fake, return_all=True)
    for rank, env in result.return_values.items():
        assert env == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "CUDA_VISIBLE_DEVICES": "3,5",
        }
    cpu = launch(_environment, num_processes=1, use_gpu=False).value
    assert cpu["CUDA_VISIBLE_DEVICES"] == os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")


def test_every_rank_is_a_fresh_process() -> None:
    def mark() -> bool:
        import builtins

        fresh = not hasattr(builtins, "_sparktrain_marker")
        builtins._sparktrain_marker = True  # type: ignore[attr-defined]
        return fresh

    assert launch(mark, num_processes=1, use_gpu=False).value is True
    assert launch(mark, num_processes=1, use_gpu=False).value is True


def _fsdp_model() -> torch.nn.Module:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    dist.init_process_group("gloo")
    return FSDP(torch.nn.Linear(4, 4), device_id=torch.device("cpu"))


def test_fsdp_module_comes_back_unwrapped() -> None:
    model = launch(_fsdp_model, num_processes=2, use_gpu=False).value
    assert type(model) is torch.nn.Linear


def _loader_with_workers(pid_dir: str) -> float:
    from torch.utils.data import DataLoader, TensorDataset

    def record(_: int) -> None:
        Path(pid_dir, str(os.getpid())).touch()

    loader = DataLoader(
        TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2, worker_init_fn=record
    )
    return float(sum(batch[0].sum() for batch in loader))


def test_data_loader_workers_inside_a_rank(tmp_path: Path) -> None:
    assert launch(_loader_with_workers, (str(tmp_path),), num_processes=1).value == 28.0
    workers = [int(p.name) for p in tmp_path.iterdir()]
    assert len(workers) == 2
    assert wait_gone(workers, within=5.0) == []


class _BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


def _raise_bad_str() -> None:
    raise _BadStr()


def test_exception_without_printable_message() -> None:
    with pytest.raises(TrainingFailedError, match=r"rank 0 on .*_BadStr") as info:
        launch(_raise_bad_str, num_processes=1, use_gpu=False)
    assert info.value.culprit is not None and "_raise_bad_str" in info.value.culprit.traceback


def _variables(*names: str) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


def test_env_option_reaches_every_rank_and_the_contract_stays_ours() -> None:
    result = launch(
        _variables, ("ST_DATA", "ST_MODE", "RANK"), num_processes=2, use_gpu=False,
        return_all=True, env={"ST_DATA": "/dbfs/data", "ST_MODE": "fast"},
    )  # fmt: skip
    assert [result.return_values[r] for r in (0, 1)] == [
        {"ST_DATA": "/dbfs/data", "ST_MODE": "fast", "RANK": str(r)} for r in (0, 1)
    ]
    with pytest.raises(ConfigError, match=r"env sets RANK, which sparktrain sets for each rank"):
        launch(_variables, num_processes=1, use_gpu=False, env={"RANK": "3"})
    with pytest.raises(ConfigError, match=r"env=\{'A': 1\} must map variable names to string"):
        launch(_variables, num_processes=1, use_gpu=False, env={"A": 1})
