"""Recovery from memory: a restart loads the newest checkpoint from the survivors' host memory.

On a ``LocalCluster`` of 2 real node processes, both ranks save (every rank its share, or its
DCP files with ``sharded=True``) and keep their files in their node's memory folder, and with
``replicas=1`` send them to the other node.
Node 1 is SIGKILLed (its memory goes with it); the elastic run restarts on node 0 alone, which
loads every file from its own memory: no byte from storage, the state equal bit for bit. On 3
nodes the restart's 2 survivors first send each other what one lacks (node 1's files are on node
2 alone), so neither reads storage either.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

import sparktrain
from sparktrain import LocalCluster, checkpoint, launch

WIDTH = 512  # 2 x 512 x 512 floats: two tensors of 1 MB, shared between the 2 ranks


def _digest(state: dict[str, Any]) -> str:
    """A digest of every tensor's bytes, in key order."""
    import torch

    hasher = hashlib.blake2b(digest_size=16)
    for key in sorted(state):
        value = state[key]
        if isinstance(value, torch.Tensor):
            hasher.update(key.encode() + value.contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def _train(ckpt_dir: str, sharded: bool) -> dict[str, Any]:
    """Save steps 1..3 (then hold until killed); after a restart, load and report the digest."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))
    into = {k: torch.zeros_like(v) for k, v in model.state_dict().items()} if sharded else None
    latest = checkpoint.load_latest(ckpt_dir, into=into)
    if latest is not None:
        sparktrain.report(storage=latest.read.get("storage", 0), memory=latest.read["memory"])
        return {"step": latest.step, "read": latest.read, "digest": _digest(latest.state)}
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(step)
        state = model.state_dict()
        checkpoint.save(state, ckpt_dir, step, replicas=1, sharded=sharded)
        checkpoint.wait(in_memory=True)  # published, and in both nodes' memory
        sparktrain.report(step=step, digest=_digest(state))
    time.sleep(120)  # node 1 is killed meanwhile; this attempt ends with it
    return {}


@pytest.mark.parametrize(
    ("nodes", "sharded"),
    [(2, False), (2, True), (3, False), (3, True)],
    ids=["2-replicated", "2-sharded", "3-replicated", "3-sharded"],
)
def test_a_restart_after_a_lost_node_loads_from_the_survivors_memory(
    tmp_path: Path, nodes: int, sharded: bool
) -> None:
    cluster = LocalCluster(nodes=nodes)
    saved: dict[int, str] = {}
    kept: set[int] = set()
    reads: dict[int, tuple[int, int]] = {}

    def on_report(rank: int, record: dict[str, Any]) -> None:
        metrics = record.get("metrics") or {}
        if "storage" in metrics:
            reads[rank] = (metrics["storage"], metrics["memory"])
        if "digest" in metrics:
            saved[record["step"]] = metrics["digest"]
            if record["step"] == 3:
                kept.add(rank)
            if len(kept) == nodes:  # every node holds its files and its neighbour's
                kept.clear()
                cluster.kill_node(1)

    result = launch(
        _train,
        (str(tmp_path / "ckpt"), sharded),
        num_processes=nodes,
        backend=cluster,
        min_processes=1,
        on_report=on_report,
        progress=False,
    )
    assert [(r.cause, r.new_world_size) for r in result.rescales] == [("lost", nodes - 1)]
    value = result.value
    assert value["step"] == 3 and value["digest"] == saved[3]
    # node 1's files came from its neighbour's copy (sent on to the other survivor on 3 nodes)
    assert sorted(reads) == list(range(nodes - 1))
    assert all(storage == 0 for storage, _memory in reads.values()), reads
    assert all(read > 2 * WIDTH * WIDTH * 4 for _storage, read in reads.values())
    assert cluster.node_pids() == {}
    assert not _memory_folders(), "the run's end removes every node's memory"


def _memory_folders() -> list[str]:
    from sparktrain.node import memory

    mine = f"sparktrain-memory-{os.getpid()}-"
    return [name for name in os.listdir(memory.root()) if name.startswith(mine)]


def _memory_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A node memory folder for this process, as a launch gives its ranks one."""
    folder = tmp_path / "memory"
    folder.mkdir()
    monkeypatch.setenv("SPARKTRAIN_CHECKPOINT_MEMORY", str(folder))
    return folder


def _save_and_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Path]:
    import torch

    folder = _memory_here(tmp_path, monkeypatch)
    state = {"w": torch.arange(300_000, dtype=torch.float32), "epoch": 4}
    checkpoint.save(state, tmp_path / "ckpt", 7, blocking=True)
    return checkpoint.load_latest(tmp_path / "ckpt"), folder


def test_one_process_loads_its_own_kept_checkpoint_from_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    import torch

    loaded, _folder = _save_and_load(tmp_path, monkeypatch)
    assert loaded is not None and loaded.state["epoch"] == 4
    assert torch.equal(loaded.state["w"], torch.arange(300_000, dtype=torch.float32))
    assert set(loaded.read) == {"memory"} and loaded.read["memory"] > 1_200_000
    said = "checkpoint step 7 loaded from memory: skeleton.pt, part-00000.bin"
    assert said in capfd.readouterr().err


def test_what_memory_lacks_is_read_from_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    _loaded, folder = _save_and_load(tmp_path, monkeypatch)
    (kept,) = list(folder.glob("*/*/part-00000.bin"))
    kept.unlink()  # as if the node that kept it was lost
    again = checkpoint.load_latest(tmp_path / "ckpt")
    assert again is not None and set(again.read) == {"memory", "storage"}
    assert again.read["storage"] > 1_200_000
    shutil.rmtree(folder)  # no memory at all: every byte from storage, the same state
    folder.mkdir()
    third = checkpoint.load_latest(tmp_path / "ckpt")
    assert third is not None and set(third.read) == {"storage"}


def test_a_newer_checkpoint_replaces_the_kept_one_and_a_stale_copy_is_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    _loaded, folder = _save_and_load(tmp_path, monkeypatch)
    checkpoint.save({"w": torch.zeros(300_000), "epoch": 5}, tmp_path / "ckpt", 8, blocking=True)
    assert len(list(folder.glob("*/*"))) == 1  # one checkpoint kept: the newest
    (kept,) = list(folder.glob("*/*"))
    kept.rename(kept.with_name("00000008-0123456789abcdef"))  # the right step, not its token
    loaded = checkpoint.load_latest(tmp_path / "ckpt")
    assert loaded is not None and loaded.state["epoch"] == 5 and set(loaded.read) == {"storage"}


def test_wait_ends_at_publication_and_only_the_next_save_waits_for_the_memory_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import torch

    from sparktrain.rank.checkpoints import memory, writer
    from sparktrain.rank.checkpoints.storage import storage_for

    folder = _memory_here(tmp_path, monkeypatch)
    store = storage_for(tmp_path / "ckpt", None)  # read as another process would: no waiting
    copying, release = threading.Event(), threading.Event()
    keep = memory.keep

    def held_keep(*args: Any, **kwargs: Any) -> None:  # the node's copy, held until released
        copying.set()
        release.wait()
        keep(*args, **kwargs)

    monkeypatch.setattr(memory, "keep", held_keep)
    state = {"w": torch.arange(300_000, dtype=torch.float32)}
    checkpoint.save(state, tmp_path / "ckpt", 1)
    assert copying.wait(120)  # published: the memory copy began
    checkpoint.wait()  # returns while the copy is held
    assert store.steps() == [1]
    assert writer.WRITER.busy() and not list(folder.glob("*/*/*.bin"))
    kept = threading.Thread(target=checkpoint.wait, kwargs={"in_memory": True})
    second = threading.Thread(target=checkpoint.save, args=(state, tmp_path / "ckpt", 2))
    kept.start()
    second.start()
    second.join(1.0)
    assert kept.is_alive() and second.is_alive()  # the staged buffers are still being copied
    assert store.steps() == [1]
    release.set()
    for thread in (kept, second):
        thread.join(120)
        assert not thread.is_alive()
    writer.WRITER.join()
    assert checkpoint.latest_step(tmp_path / "ckpt") == 2
    assert [p.parent.name[:8] for p in folder.glob("*/*/*.bin")] == ["00000002"]


def test_replicas_must_be_0_or_1(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"replicas=2: pass 0 .* or 1"):
        checkpoint.save({"a": 1}, tmp_path, 1, replicas=2)


def test_no_room_in_memory_is_said_once_and_the_checkpoint_still_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    import errno

    import torch

    from sparktrain.rank.checkpoints import memory

    write = memory.write

    def full(path: Path, fill: Any) -> None:  # the device fills up in the middle of a file
        def cut(handle: Any) -> None:
            handle.write(b"x" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")

        write(path, cut)

    monkeypatch.setattr(memory, "write", full)
    monkeypatch.setattr(memory, "_SAID", set())
    folder = _memory_here(tmp_path, monkeypatch)
    for step in (1, 2):
        checkpoint.save({"w": torch.ones(1000)}, tmp_path / "ckpt", step, blocking=True)
    err = capfd.readouterr().err
    assert err.count("is not kept in memory") == 1 and "No space left on device" in err
    assert not [p for p in folder.rglob("*") if p.is_file()], "nothing half kept is left"
    loaded = checkpoint.load_latest(tmp_path / "ckpt")
    assert loaded is not None and loaded.step == 2 and set(loaded.read) == {"storage"}


def test_in_memory_false_keeps_nothing_and_a_restart_reads_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    folder = _memory_here(tmp_path, monkeypatch)
    checkpoint.save({"w": torch.ones(9)}, tmp_path / "ckpt", 1, blocking=True, in_memory=False)
    assert not list(folder.rglob("*.bin"))
    loaded = checkpoint.load_latest(tmp_path / "ckpt")
    assert loaded is not None and set(loaded.read) == {"storage"}


def test_every_dtype_and_shape_comes_back_from_memory_as_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    _memory_here(tmp_path, monkeypatch)
    state = {
        "bf16": torch.randn(700_000).to(torch.bfloat16),  # over 1 MiB
        "half": torch.randn(3, 5).half(),
        "flags": torch.tensor([True, False, True]),
        "ids": torch.arange(7, dtype=torch.int64).reshape(7, 1),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "odd": torch.arange(3, dtype=torch.uint8),
        "rng": torch.get_rng_state(),
    }
    checkpoint.save(state, tmp_path / "ckpt", 1, blocking=True)
    loaded = checkpoint.load_latest(tmp_path / "ckpt")
    assert loaded is not None and set(loaded.read) == {"memory"}
    for key, tensor in state.items():
        got = loaded.state[key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, key
        assert torch.equal(got, tensor), key
    torch.set_rng_state(loaded.state["rng"])  # a reader that ignores a view's offset
    got = loaded.state["ids"]
    got += 1  # private: changing a loaded tensor never changes the kept copy
    again = checkpoint.load_latest(tmp_path / "ckpt")
    assert again is not None and torch.equal(again.state["ids"], state["ids"])


def test_a_damaged_copy_in_memory_is_read_from_storage_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    import torch

    _loaded, folder = _save_and_load(tmp_path, monkeypatch)
    (kept,) = list(folder.glob("*/*/part-00000.bin"))
    kept.write_bytes(kept.read_bytes()[:4000])  # cut inside the tensor
    loaded = checkpoint.load_latest(tmp_path / "ckpt")
    assert loaded is not None and loaded.read["storage"] > 1_200_000
    assert torch.equal(loaded.state["w"], torch.arange(300_000, dtype=torch.float32))
    assert "part-00000.bin is unreadable" in capfd.readouterr().err


def test_too_little_room_keeps_nothing_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    import torch

    from sparktrain.rank.checkpoints import memory

    monkeypatch.setattr(memory, "HEADROOM_BYTES", 1 << 60)  # more than any disk has
    monkeypatch.setattr(memory, "_SAID", set())
    folder = _memory_here(tmp_path, monkeypatch)
    checkpoint.save({"w": torch.ones(1000)}, tmp_path / "ckpt", 1, blocking=True)
    assert not [p for p in folder.rglob("*") if p.is_file()]
    assert "would leave less than" in capfd.readouterr().err


def _save_then(ckpt_dir: str, fail: bool) -> int:
    import torch

    checkpoint.save({"w": torch.ones(300_000)}, ckpt_dir, 1)
    checkpoint.wait()
    if fail:
        raise ValueError("after the save")
    return 1


@pytest.mark.parametrize("fail", [False, True])
def test_a_local_run_removes_its_nodes_memory_at_its_end(tmp_path: Path, fail: bool) -> None:
    from sparktrain import TrainingFailedError

    before = set(_memory_folders())
    if fail:
        with pytest.raises(TrainingFailedError, match="after the save"):
            launch(_save_then, (str(tmp_path), True), num_processes=2, progress=False)
    else:
        launch(_save_then, (str(tmp_path), False), num_processes=2, progress=False)
    assert set(_memory_folders()) == before
