"""Injected faults on real processes: restarts that resume, atomic checkpoints, hangs located."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import sparktrain
from sparktrain import HangError, TorchDistributor, TrainingFailedError, checkpoint, launch


def resumable_train(ckpt_dir: str, epochs: int, kill_rank: int, kill_epoch: int) -> dict:
    """The seeds' MLP with a checkpoint every epoch; ``kill_rank`` SIGKILLs itself once."""
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 784, generator=g)
    data = TensorDataset(x, (x @ torch.randn(784, 10, generator=g)).argmax(1))
    model = DDP(mlp)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    start = 0
    latest = checkpoint.load_latest(ckpt_dir)
    if latest is not None:
        mlp.load_state_dict(latest.state["model"])
        optimizer.load_state_dict(latest.state["optimizer"])
        start = latest.state["epoch"] + 1
    print(f"attempt {sparktrain.restart_count()} starts at epoch {start}")
    for epoch in range(start, epochs):
        if rank == kill_rank and epoch == kill_epoch and sparktrain.restart_count() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        sampler.set_epoch(epoch)
        for bx, by in loader:
            loss = nn.functional.cross_entropy(model(bx), by)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        state = {"model": mlp.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
        checkpoint.save(state, ckpt_dir, step=epoch)
    dist.destroy_process_group()
    return {"params": mlp.state_dict(), "start": start, "restart": sparktrain.restart_count()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_restart_resumes_bit_for_bit(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    clean = launch(
        resumable_train, (str(tmp_path / "clean"), 6, -1, -1), num_processes=2, use_gpu=False
    ).value
    faulty = TorchDistributor(2, True, False, max_restarts=1).run(
        resumable_train, str(tmp_path / "faulty"), 6, 1, 3
    )
    # Killed as epoch 3 begins: epoch 2's checkpoint may still have been in the background
    # writer (then epoch 1's is the newest published one), never half of it.
    assert faulty["start"] in (2, 3) and faulty["restart"] == 1
    assert _same(clean["params"], faulty["params"])  # bit for bit
    err = capfd.readouterr().err
    assert "rank 1 on" in err and "killed by SIGKILL" in err and "attempt 2 of 2" in err
    # The restart read the checkpoint from the node's memory, not the folder.
    assert f"checkpoint step {faulty['start'] - 1} loaded from memory: skeleton.pt" in err
    assert checkpoint.latest_step(tmp_path / "faulty") == 5
    assert len(list((tmp_path / "faulty").iterdir())) == 3  # keep=3


def test_without_restarts_the_kill_is_named(tmp_path: Path) -> None:
    with pytest.raises(TrainingFailedError) as info:
        launch(resumable_train, (str(tmp_path), 6, 1, 1), num_processes=2, use_gpu=False)
    assert info.value.culprit is not None and info.value.culprit.rank == 1
    assert info.value.culprit.signal_name == "SIGKILL" and info.value.attempts == 1


def _always_fails() -> None:
    raise RuntimeError(f"attempt {sparktrain.restart_count()} failed")


def test_last_attempt_is_reported_with_the_count() -> None:
    with pytest.raises(TrainingFailedError) as info:
        launch(_always_fails, num_processes=2, use_gpu=False, max_restarts=2)
    assert info.value.attempts == 3
    assert "RuntimeError: attempt 2 failed" in str(info.value)
    assert "(attempt 3 of 3)" in str(info.value)


CRASH_MID_WRITE = """
import os, signal, sys, torch
from sparktrain import checkpoint
from sparktrain.rank.checkpoints import parts
directory = sys.argv[1]
checkpoint.save({"w": torch.arange(4.0)}, directory, step=1)
checkpoint.wait()
def dying_write(handle, tensors):
    handle.write(b"half a checkpoint")
    handle.flush()
    os.kill(os.getpid(), signal.SIGKILL)
parts.write = dying_write
checkpoint.save({"w": torch.zeros(4)}, directory, step=2)
"""


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CRASH_MID_WRITE, str(tmp_path)], capture_output=True, check=False
    )
    assert done.returncode == -signal.SIGKILL
    assert any(p.name.startswith(".step-00000002.tmp") for p in tmp_path.iterdir())  # the wreck
    latest = checkpoint.load_latest(tmp_path)
    assert latest is not None and latest.step == 1
    assert torch.equal(latest.state["w"], torch.arange(4.0))
    checkpoint.save({"w": torch.ones(4)}, tmp_path, step=2)  # the next save cleans up
    checkpoint.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]


def _deadlock() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    print("entering the collectives")
    if dist.get_rank() == 0:
        dist.all_reduce(t)  # LINE-ALL-REDUCE
    else:
        dist.recv(t, src=0)  # rank 1 skipped the all_reduce: LINE-RECV


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(marker))


def test_deadlock_is_detected_and_located() -> None:
    started = time.monotonic()
    with pytest.raises(HangError) as info:
        launch(_deadlock, num_processes=2, use_gpu=False, hang_timeout=4)
    elapsed = time.monotonic() - started
    sites = info.value.sites
    assert sites[0].user_line == _line_of("# LINE-ALL-REDUCE"), sites[0].stack
    assert "all_reduce" in str(info.value)
    assert sites[1].user_line == _line_of("LINE-RECV"), sites[1].stack
    assert sites[1].user_function == "_deadlock"
    assert f"test_faults.py:{_line_of('LINE-RECV')}" in str(info.value)
    assert elapsed < 4 + 15
    print(info.value)


def _import_from(folder: str, name: str) -> str:
    import importlib

    sys.path.insert(0, folder)
    importlib.import_module(name)
    return name


def test_a_long_import_on_the_cpu_is_progress(tmp_path: Path) -> None:
    # import deepspeed on a loaded machine: seconds of CPU and not a line of output
    (tmp_path / "busy_at_import.py").write_text(
        "import time\nend = time.process_time() + 4\nwhile time.process_time() < end:\n    pass\n"
    )
    result = launch(
        _import_from, (str(tmp_path), "busy_at_import"), num_processes=1, use_gpu=False,
        hang_timeout=2,
    )  # fmt: skip
    assert result.value == "busy_at_import"


def test_an_import_that_waits_is_still_a_hang(tmp_path: Path) -> None:
    (tmp_path / "waits_at_import.py").write_text("import time\ntime.sleep(60)  # LINE-WAITS\n")
    with pytest.raises(HangError) as info:
        launch(
            _import_from, (str(tmp_path), "waits_at_import"), num_processes=1, use_gpu=False,
            hang_timeout=2,
        )  # fmt: skip
    (site,) = info.value.sites.values()
    assert site.user_file.endswith("waits_at_import.py") and site.user_line == 2


def _reporting_loop(seconds: float) -> int:
    end = time.monotonic() + seconds
    step = 0
    while time.monotonic() < end:
        time.sleep(0.2)
        step += 1
        sparktrain.report(step=step)
    return step


def test_reports_count_as_progress() -> None:
    assert launch(_reporting_loop, (3.0,), num_processes=1, use_gpu=False, hang_timeout=1).value > 5


def test_errors_survive_pickling() -> None:
    import pickle

    with pytest.raises(TrainingFailedError) as info:
        launch(_always_fails, num_processes=1, use_gpu=False)
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is TrainingFailedError and copy.culprit == info.value.culprit
    assert str(copy) == str(info.value)


@pytest.mark.parametrize(("option", "value"), [("max_restarts", -1), ("hang_timeout", 0)])
def test_bad_fault_options(option: str, value: object) -> None:
    with pytest.raises(sparktrain.ConfigError, match=option):
        launch(print, num_processes=1, use_gpu=False, **{option: value})  # type: ignore[arg-type]


def _save_without_process_group(folder: str) -> list[str]:
    if os.environ["RANK"] == "1":
        time.sleep(1.0)  # if rank 1 wrongly wrote, its write would be the one that stays
    checkpoint.save({"rank": int(os.environ["RANK"])}, folder, step=0)
    return sorted(p.name for p in Path(folder).iterdir())


def test_only_rank_zero_writes_without_a_process_group(tmp_path: Path) -> None:
    launch(_save_without_process_group, (str(tmp_path),), num_processes=2, use_gpu=False)
    latest = checkpoint.load_latest(tmp_path)
    assert latest is not None and latest.state == {"rank": 0}
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000000"]


def kill_the_fork_server_once() -> int:
    """On the first attempt, rank 0 kills the fork server (its parent): infrastructure lost."""
    import signal as signals

    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if sparktrain.restart_count() == 0 and dist.get_rank() == 0:
        os.kill(os.getppid(), signals.SIGKILL)
        time.sleep(30)  # dies with its server (PR_SET_PDEATHSIG)
    dist.barrier()
    return sparktrain.restart_count()


def test_a_lost_fork_server_is_a_cluster_error_and_is_restarted() -> None:
    from sparktrain import ClusterError

    with pytest.raises(ClusterError, match=r"fork server .* exited unexpectedly"):
        launch(kill_the_fork_server_once, num_processes=2, use_gpu=False, timeout=60)
    result = launch(
        kill_the_fork_server_once, num_processes=2, use_gpu=False, timeout=60, max_restarts=1
    )
    assert (result.value, result.attempts) == (1, 2)


def _steps_with_a_pid_file(folder: str) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    Path(folder, f"pid-{dist.get_rank()}").write_text(str(os.getpid()))
    for _ in range(100):
        dist.all_reduce(torch.ones(1))
        time.sleep(0.1)
    return dist.get_world_size()


def _drop_node_channel(folder: Path, driver: int) -> str:
    """``ss -K`` the TCP connection from rank 1's node process to the driver's channel."""
    deadline = time.monotonic() + 60
    while not (folder / "pid-1").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    server = sparktrain.ground.procfs.parent_of(int((folder / "pid-1").read_text()))
    node = sparktrain.ground.procfs.parent_of(server or 0)

    def sockets(pid: int | None, *state: str) -> list[list[str]]:
        command = ["ss", "-tnpH", *state]
        listed = subprocess.run(command, check=False, capture_output=True, text=True).stdout
        return [line.split() for line in listed.splitlines() if f"pid={pid}," in line]

    ours = {row[3].rsplit(":", 1)[1] for row in sockets(driver, "-l")}
    for row in sockets(node, "state", "established"):
        mine, peer = row[2].rsplit(":", 1)[1], row[3].rsplit(":", 1)[1]
        if peer in ours:
            which = f"( sport = :{mine} and dport = :{peer} )"
            done = subprocess.run(["ss", "-K", "state", "established", which], check=False)
            return "dropped" if done.returncode == 0 else "ss -K failed"
    return "no channel found"


def test_a_dropped_node_channel_is_a_lost_node_not_a_success(tmp_path: Path) -> None:
    """Found by benchmarks/chaos.py: the run returned no values and raised nothing."""
    from concurrent.futures import ThreadPoolExecutor

    if subprocess.run(["ss", "-V"], capture_output=True, check=False).returncode != 0:
        pytest.skip("needs iproute2's ss (ss -K) to drop a connection")
    with ThreadPoolExecutor(1) as pool:
        dropped = pool.submit(_drop_node_channel, tmp_path, os.getpid())
        try:
            launch(
                _steps_with_a_pid_file, (str(tmp_path),), num_processes=2, timeout=120,
                backend=sparktrain.LocalCluster(nodes=2),
            )  # fmt: skip
        except sparktrain.ClusterError as exc:
            raised: Exception | None = exc
        else:
            raised = None
    if dropped.result() != "dropped":
        pytest.skip(f"the connection could not be dropped here: {dropped.result()}")
    assert raised is not None, "the run passed for one that ended well"
    assert "node 1 on node1: its channel to the driver broke" in str(raised)
