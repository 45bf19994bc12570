"""Asynchronous checkpoints: the loop waits for one copy, the write runs behind it, atomically.

Real processes throughout: ranks that ``init_process_group``, writers killed with SIGKILL at
random moments, a failure inside one rank's write.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparktrain import CheckpointError, ConfigError, checkpoint, launch


def test_the_saved_state_is_the_state_at_save_even_when_the_loop_changes_it_at_once(
    tmp_path: Path,
) -> None:
    state = {"w": torch.arange(300_000.0), "b": torch.ones(3), "epoch": 4, "seen": [1, 2]}
    assert checkpoint.save(state, tmp_path, step=1) == tmp_path / "step-00000001"
    state["w"].mul_(-1)  # the loop goes on the moment save returns
    state["b"].zero_()
    state["seen"].append(3)
    state["epoch"] = 5
    checkpoint.wait()
    found = checkpoint.load_latest(tmp_path)
    assert found is not None and found.step == 1
    assert torch.equal(found.state["w"], torch.arange(300_000.0))
    assert torch.equal(found.state["b"], torch.ones(3))
    assert (found.state["epoch"], found.state["seen"]) == (4, [1, 2])


def test_blocking_publishes_before_it_returns_and_a_process_sees_its_own_saves(
    tmp_path: Path,
) -> None:
    checkpoint.save({"w": torch.zeros(2)}, tmp_path, step=3, blocking=True)
    assert (tmp_path / "step-00000003" / "COMPLETE").is_file()
    checkpoint.save({"w": torch.ones(2)}, tmp_path, step=4)
    assert checkpoint.latest_step(tmp_path) == 4  # waits for this process's own write


def test_a_crash_between_the_renames_of_a_step_saved_again_keeps_its_previous_version(
    tmp_path: Path,
) -> None:
    checkpoint.save({"w": torch.ones(3)}, tmp_path, step=5, blocking=True)
    # What a crash right after the first rename of a second save of step 5 leaves behind:
    (tmp_path / "step-00000005").rename(tmp_path / ".step-00000005.old")
    (tmp_path / ".step-00000005.tmp").mkdir()
    (tmp_path / ".step-00000005.tmp" / "part-00000.bin").write_bytes(b"half")
    found = checkpoint.load_latest(tmp_path)
    assert found is not None and found.step == 5
    assert torch.equal(found.state["w"], torch.ones(3))
    checkpoint.save({"w": torch.zeros(3)}, tmp_path, step=6, keep=2, blocking=True)
    assert checkpoint.latest_step(tmp_path) == 6
    assert (tmp_path / ".step-00000005.old" / "COMPLETE").is_file()  # kept: step 5's only copy
    checkpoint.save({"w": torch.full((3,), 7.0)}, tmp_path, step=7, keep=2, blocking=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000007"]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("gs://b/r", "pip install gcsfs"),
        ("abfs://c@a/p", "pip install adlfs"),
        ("dbfs:/ckpt", "/dbfs is not mounted here"),
        ("nosuch://b/r", "fsspec cannot open nosuch://"),
    ],
)
def test_a_url_without_its_package_is_refused_by_name_and_never_taken_for_a_folder(
    url: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(says)):
        checkpoint.save({"w": torch.zeros(1)}, url, step=1)
    with pytest.raises(ConfigError, match=re.escape(says)):
        checkpoint.load_latest(url)
    assert list(tmp_path.iterdir()) == []  # no folder called 'gs:' here


def test_bad_values_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="if_busy='later'"):
        checkpoint.save({}, tmp_path, step=1, if_busy="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep=-1"):
        checkpoint.save({}, tmp_path, step=1, keep=-1)
    with pytest.raises(ValueError, match=r"step=1\.5"):
        checkpoint.save({}, tmp_path, step=1.5)  # type: ignore[arg-type]


def _two_ranks_share_the_write(folder: str) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same (replicated) state on both ranks
    state = {"a": torch.randn(512, 1024), "b": torch.randn(400, 1024), "rng": torch.ones(4) * rank}
    checkpoint.save(state, folder, step=7)
    state["a"].zero_()  # both ranks change their copy at once
    state["b"].zero_()
    checkpoint.wait()
    found = checkpoint.load_latest(folder)
    torch.manual_seed(0)
    a, b = torch.randn(512, 1024), torch.randn(400, 1024)
    assert found is not None
    return {
        "same": torch.equal(found.state["a"], a) and torch.equal(found.state["b"], b),
        "rng": found.state["rng"].tolist(),  # a rank's small tensor comes from rank 0
        "world_size": found.world_size,
    }


def test_two_ranks_each_write_a_share_and_the_checkpoint_is_whole(tmp_path: Path) -> None:
    run = launch(
        _two_ranks_share_the_write,
        (str(tmp_path),),
        num_processes=2,
        use_gpu=False,
        return_all=True,
    )
    for value in run.return_values.values():
        assert value == {"same": True, "rng": [0.0] * 4, "world_size": 2}
    folder = tmp_path / "step-00000007"
    parts = {p.name: p.stat().st_size for p in folder.glob("part-*.bin")}
    assert set(parts) == {"part-00000.bin", "part-00001.bin"}
    assert min(parts.values()) > 1_500_000  # each rank wrote one of the two large tensors


def _same_tensors_in_another_order(folder: str) -> list[float]:
    from datetime import timedelta

    import torch.distributed as dist

    from sparktrain.rank.checkpoints import coordinate

    dist.init_process_group("gloo", timeout=timedelta(seconds=123))
    a, b = torch.full((400_000,), 1.0), torch.full((400_000,), 2.0)
    state = {"a": a, "b": b} if dist.get_rank() == 0 else {"b": b, "a": a}
    checkpoint.save(state, folder, step=1, blocking=True)
    found = checkpoint.load_latest(folder)
    assert found is not None
    groups = coordinate.groups()
    assert groups is not None
    waits = {coordinate.world_timeout(g).total_seconds() for g in (groups.agree, groups.write)}
    assert waits == {123.0}, waits  # the run's timeout, not torch's 30 minutes
    return [float(found.state["a"][0]), float(found.state["b"][0])]


def test_equal_shapes_under_keys_in_another_order_are_not_mixed_up(tmp_path: Path) -> None:
    """Two ranks whose tensors have the same shapes but sit under keys in another order are
    not alike: rank 0's state is written whole, and each key loads its own tensor. The
    checkpoint's own groups wait as long as the run's group does."""
    run = launch(
        _same_tensors_in_another_order,
        (str(tmp_path),),
        num_processes=2,
        use_gpu=False,
        return_all=True,
    )
    assert run.return_values == {0: [1.0, 2.0], 1: [1.0, 2.0]}


def _one_rank_fails_its_write(folder: str) -> str:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    checkpoint.save({"w": torch.ones(400_000)}, folder, step=1, blocking=True)
    if dist.get_rank() == 1:
        from sparktrain.rank.checkpoints import parts

        def full_disk(handle: object, tensors: object) -> None:
            raise OSError(28, "No space left on device")

        parts.write = full_disk  # type: ignore[assignment]
    checkpoint.save({"w": torch.zeros(400_000), "x": torch.zeros(400_000)}, folder, step=2)
    try:
        checkpoint.wait()
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_a_rank_whose_write_fails_is_named_on_every_rank_and_nothing_is_published(
    tmp_path: Path,
) -> None:
    run = launch(
        _one_rank_fails_its_write, (str(tmp_path),), num_processes=2, use_gpu=False, return_all=True
    )
    said = run.return_values
    assert "rank 1 could not write its part: OSError" in said[1], said
    assert "No space left on device" in said[1]
    assert "rank(s) 1 could not write its part" in said[0] and "their own error says why" in said[0]
    assert checkpoint.latest_step(tmp_path) == 1  # the previous one is still the newest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def _skip_when_busy(folder: str) -> list[object]:
    import time

    import torch.distributed as dist

    from sparktrain.rank.checkpoints import storage

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:  # rank 1's disk is slow: its writer is still busy at the next save
        real = storage.LocalStorage.write

        def slow(self: object, *args: object, **kwargs: object) -> int:
            time.sleep(1.5)
            return real(self, *args, **kwargs)  # type: ignore[arg-type]

        storage.LocalStorage.write = slow  # type: ignore[method-assign]
    saved = [checkpoint.save({"w": torch.ones(2)}, folder, step=1)]
    saved.append(checkpoint.save({"w": torch.ones(2) * 2}, folder, step=2, if_busy="skip"))
    saved.append(checkpoint.save({"w": torch.ones(2) * 3}, folder, step=3))  # waits
    checkpoint.wait()
    return [None if s is None else Path(str(s)).name for s in saved]


def test_if_busy_skip_skips_on_every_rank_together(tmp_path: Path) -> None:
    run = launch(_skip_when_busy, (str(tmp_path),), num_processes=2, use_gpu=False, return_all=True)
    for value in run.return_values.values():  # rank 0's writer was idle, and it skipped too
        assert value == ["step-00000001", None, "step-00000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000003"]


KILLED_MID_WRITE = """
import json, os, random, signal, sys, time
import torch
from sparktrain import checkpoint

folder, trials = sys.argv[1], int(sys.argv[2])
options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
longest = float(sys.argv[4]) if len(sys.argv) > 4 else 0.4  # the latest kill, in seconds
torch.set_num_threads(1)  # no OpenMP pool in the parent: a forked child could not use it
rng = random.Random(5)
warm = folder.rstrip("/") + "/warm"
checkpoint.save({"w": torch.zeros(1)}, warm, step=0, blocking=True, storage_options=options)
seen = {"none": 0, "published": 0}
for trial in range(trials):
    here = folder.rstrip("/") + f"/trial-{trial}"
    child = os.fork()
    if child == 0:
        step = 0
        while True:
            step += 1
            state = {"w": torch.full((1_000_000,), float(step)), "step": step}
            checkpoint.save(state, here, step=step, keep=2, storage_options=options)
    time.sleep(rng.uniform(0.0, longest))
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    found = checkpoint.load_latest(here, storage_options=options)
    if found is None:
        seen["none"] += 1
        continue
    state = found.state
    assert state["step"] == found.step, (trial, found.step, state["step"])
    assert torch.equal(state["w"], torch.full((1_000_000,), float(found.step))), trial
    if options is None:  # every older folder is a whole, published one too
        for name in os.listdir(here):
            if name.startswith("step-"):
                assert os.path.isfile(os.path.join(here, name, "COMPLETE")), name
    seen["published"] += 1
print(seen)
"""


def test_a_writer_killed_at_random_moments_leaves_the_previous_or_the_new_checkpoint_whole(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path), "100"],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = eval(done.stdout.strip().splitlines()[-1])  # {'none': n, 'published': m}
    assert seen["none"] + seen["published"] == 100
    assert seen["published"] > 50  # most kills came after a checkpoint was published


def test_back_pressure_keeps_one_checkpoint_in_flight_when_every_step_saves(
    tmp_path: Path,
) -> None:
    script = """
import resource, sys, torch
from sparktrain import checkpoint
from sparktrain.rank.checkpoints.writer import WRITER
state = {"w": torch.zeros(8_000_000)}  # 32 MB
peaks, busy = [], 0
for step in range(40):
    state["w"].fill_(step)
    busy += WRITER.busy()
    checkpoint.save(state, sys.argv[1], step=step, keep=1)
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
checkpoint.wait()
print(busy, peaks[5], peaks[-1])
"""
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    busy, early, last = (int(x) for x in done.stdout.split())
    assert busy > 0  # saves did find the previous one still writing
    assert last - early < 32_000  # KiB: not one more 32 MB copy after the first saves
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000039"]
    found = checkpoint.load_latest(tmp_path)
    assert found is not None and torch.equal(found.state["w"], torch.full((8_000_000,), 39.0))


def test_a_rank_that_returns_right_after_save_still_publishes(tmp_path: Path) -> None:
    def body(folder: str) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        checkpoint.save({"w": torch.ones(1_000_000)}, folder, step=9)
        dist.destroy_process_group()  # the writer's groups go too: it finishes first

    launch(body, (str(tmp_path),), num_processes=2, use_gpu=False)
    assert checkpoint.latest_step(tmp_path) == 9
    assert os.listdir(tmp_path) == ["step-00000009"]


def _rank1_disk_full_unhandled(folder: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        from sparktrain.rank.checkpoints import parts

        def full_disk(handle: object, tensors: object) -> None:
            raise OSError(28, "No space left on device")

        parts.write = full_disk  # type: ignore[assignment]
    checkpoint.save({"w": torch.zeros(400_000), "x": torch.zeros(400_000)}, folder, step=1)
    # The function returns; the rank waits for its write, which failed.


def test_the_rank_whose_write_failed_is_the_culprit_not_the_peer_that_heard_of_it(
    tmp_path: Path,
) -> None:
    from sparktrain import TrainingFailedError

    with pytest.raises(TrainingFailedError) as info:
        launch(_rank1_disk_full_unhandled, (str(tmp_path),), num_processes=2, use_gpu=False)
    assert info.value.culprit is not None and info.value.culprit.rank == 1
    assert "No space left on device" in str(info.value)
    assert checkpoint.latest_step(tmp_path) is None


def _rank0_cannot_stage(folder: str, sharded: bool) -> list[str]:
    import threading

    import torch.distributed as dist

    dist.init_process_group("gloo")
    said = []
    state: dict = {"w": torch.ones(400_000), "x": torch.ones(400_000)}
    if dist.get_rank() == 0:
        state["lock"] = threading.Lock()  # rank 0's state cannot be copied or pickled
    try:
        checkpoint.save(state, folder, step=1, sharded=sharded)
        checkpoint.wait()
    except CheckpointError as exc:
        said.append(str(exc))
    state.pop("lock", None)
    checkpoint.save(state, folder, step=2, sharded=sharded)  # the ranks' writers are in step
    checkpoint.wait()
    said.append(str(checkpoint.latest_step(folder)))
    return said


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_a_rank_that_cannot_stage_fails_alone_and_the_next_save_works(
    tmp_path: Path, sharded: bool
) -> None:
    run = launch(
        _rank0_cannot_stage,
        (str(tmp_path), sharded),
        num_processes=2,
        use_gpu=False,
        return_all=True,
        timeout=120,  # a sharded write is collective: a peer must not wait in it
    )
    zero, one = run.return_values[0], run.return_values[1]
    assert "rank 0 could not stage its part" in zero[0] and "lock" in zero[0], zero
    assert "rank(s) 0 could not stage its part or prepare the folder" in one[0], one
    assert zero[1] == one[1] == "2"


def test_loading_refuses_what_it_cannot_do_by_name(tmp_path: Path) -> None:
    import numpy as np

    checkpoint.save({"w": torch.ones(2)}, tmp_path, step=np.int64(3), blocking=True)
    assert checkpoint.latest_step(tmp_path) == 3
    with pytest.raises(ValueError, match="map_location="):
        checkpoint.load_latest(tmp_path, map_location={"cuda:1": "cuda:0"})
    with pytest.raises(ValueError, match="replicated state"):
        checkpoint.load_latest(tmp_path, into={"w": torch.zeros(2)})


def test_a_modules_state_dict_keeps_its_version_metadata_and_sizes_stay_sizes(
    tmp_path: Path,
) -> None:
    norm = torch.nn.BatchNorm1d(3)
    checkpoint.save({"norm": norm.state_dict(), "shape": torch.Size([2, 3])}, tmp_path, step=1)
    found = checkpoint.load_latest(tmp_path)
    assert found is not None
    assert found.state["norm"]._metadata == norm.state_dict()._metadata  # module versions
    assert type(found.state["shape"]) is torch.Size
