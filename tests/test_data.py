"""sparktrain.data: Parquet and Delta sources streamed into ranks, in order, resumable."""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sparktrain import ConfigError, launch
from sparktrain.data import StreamingDataset, from_delta, from_parquet
from sparktrain.data import order as data_order

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = 1001  # does not divide by 2, 3 or 4 ranks


def write_ids(folder: Path, rows: int = ROWS, files: int = 3, group: int = 97) -> Path:
    """Parquet files of ``rows`` rows: ``id``, ``x`` (2 floats = id, -id), ``flag``."""
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, rows, files + 1).astype(int)
    for number in range(files):
        ids = np.arange(bounds[number], bounds[number + 1])
        pairs = np.stack([ids, -ids], axis=1).astype(np.float32).ravel()
        table = pa.table(
            {
                "id": ids,
                "x": pa.FixedSizeListArray.from_arrays(pa.array(pairs), 2),
                "flag": ids % 2 == 0,
            }
        )
        pq.write_table(table, folder / f"part-{number}.parquet", row_group_size=group)
    return folder


def epoch_ids(dataset: StreamingDataset, workers: int = 0) -> list[list[int]]:
    """The ids of each batch of one pass."""
    source = dataset if workers == 0 else dataset.loader(num_workers=workers)
    return [batch["id"].tolist() for batch in source]


@pytest.mark.parametrize(("world", "uneven"), [(2, "pad"), (3, "drop"), (4, "pad")])
def test_every_row_once_and_equal_batches(tmp_path: Path, world: int, uneven: str) -> None:
    path = write_ids(tmp_path / "data")
    shares = [
        epoch_ids(from_parquet(path, batch_size=32, rank=r, world_size=world, uneven=uneven))
        for r in range(world)
    ]
    assert len({len(batches) for batches in shares}) == 1  # every rank: the same batch count
    seen = [i for batches in shares for batch in batches for i in batch]
    share = ROWS // world if uneven == "drop" else -(-ROWS // world)
    assert len(seen) == share * world
    if uneven == "drop":
        assert len(set(seen)) == len(seen) == ROWS - ROWS % world
    else:
        assert set(seen) == set(range(ROWS))  # every row, and the padding repeats a few


def test_columns_are_tensors_that_match(tmp_path: Path) -> None:
    path = write_ids(tmp_path / "data")
    batch = next(iter(from_parquet(path, batch_size=50, world_size=1)))
    assert batch["x"].shape == (50, 2) and batch["x"].dtype == torch.float32
    assert torch.equal(batch["x"][:, 0].long(), batch["id"])
    assert torch.equal(batch["flag"], batch["id"] % 2 == 0)


def test_epochs_differ_and_seed_repeats(tmp_path: Path) -> None:
    path = write_ids(tmp_path / "data")
    dataset = from_parquet(path, batch_size=16, rank=1, world_size=2)
    first, second = epoch_ids(dataset), epoch_ids(dataset)  # a pass moves to the next epoch
    assert dataset.epoch == 2 and first != second
    again = from_parquet(path, batch_size=16, rank=1, world_size=2)
    assert epoch_ids(again) == first
    again.set_epoch(1)
    assert epoch_ids(again) == second
    other_seed = from_parquet(path, batch_size=16, rank=1, world_size=2, seed=7)
    assert epoch_ids(other_seed) != first
    in_order = epoch_ids(from_parquet(path, batch_size=16, world_size=1, shuffle=False))
    assert [i for b in in_order for i in b] == list(range(ROWS))
    for shuffle in (False, True):  # batches longer than a decoded chunk (256 rows)
        big = epoch_ids(from_parquet(path, batch_size=700, world_size=1, shuffle=shuffle))
        assert [len(b) for b in big] == [700, 301]
        flat = [i for b in big for i in b]
        assert flat == list(range(ROWS)) if not shuffle else sorted(flat) == list(range(ROWS))


@pytest.mark.parametrize("workers", [0, 2])
def test_state_dict_resumes_at_the_next_batch(tmp_path: Path, workers: int) -> None:
    path = write_ids(tmp_path / "data")

    def dataset() -> StreamingDataset:
        return from_parquet(path, batch_size=16, rank=0, world_size=2, shuffle_buffer=100)

    whole = epoch_ids(dataset(), workers)
    for stop in (1, 7, len(whole) - 1):
        reader = dataset()
        source = reader if workers == 0 else reader.loader(num_workers=workers)
        iterator = iter(source)
        head = [next(iterator)["id"].tolist() for _ in range(stop)]
        state = reader.state_dict()
        del iterator
        resumed = dataset()
        resumed.load_state_dict(state)
        assert head + epoch_ids(resumed, workers) == whole, stop
        assert resumed.epoch == 1  # the resumed pass ended the epoch


def test_a_batch_still_held_is_never_written_again(tmp_path: Path) -> None:
    """Shuffled batches are views of reused window buffers: one held (or a view of it, or its
    storage) keeps its own."""
    path = write_ids(tmp_path / "data")

    def dataset() -> StreamingDataset:
        return from_parquet(path, batch_size=16, rank=0, world_size=1, shuffle_buffer=100)

    expected = epoch_ids(dataset())
    assert len(expected) > 4 * 4  # more batches than the buffers kept: they would be reused
    held = [batch["id"] for batch in dataset()]  # the batch's own tensors
    views = [batch["x"][:, 0] for batch in dataset()]  # views of them, the batches dropped
    arrays = [batch["id"].numpy() for batch in dataset()]  # numpy arrays over them
    storages = [
        (batch["id"].untyped_storage(), batch["id"].storage_offset(), len(batch["id"]))
        for batch in dataset()
    ]  # a batch is a view of its window's buffer: it starts where it starts in it
    assert [h.tolist() for h in held] == expected
    assert [[int(v) for v in view.tolist()] for view in views] == expected
    assert [a.tolist() for a in arrays] == expected
    as_ids = [torch.empty(0, dtype=torch.int64).set_(s, o, (n,)).tolist() for s, o, n in storages]
    assert as_ids == expected  # the storage object alone, its batch dropped
    assert sorted(i for batch in expected for i in batch) == list(range(ROWS))


def test_rows_whose_width_changes_inside_a_window_keep_their_values(tmp_path: Path) -> None:
    """A list column whose rows have one width in a row group and another in the next: a
    shuffled window that spans them gives lists, each row its own values."""
    writer = pq.ParquetWriter(
        tmp_path / "w.parquet", pa.schema([("id", pa.int64()), ("v", pa.list_(pa.float32()))])
    )
    for group, width in enumerate((3, 4, 3, 5)):
        ids = np.arange(group * 300, (group + 1) * 300)
        values = pa.array([[float(i)] * width for i in ids], pa.list_(pa.float32()))
        writer.write_table(pa.table({"id": ids, "v": values}))
    writer.close()
    seen = []
    for batch in from_parquet(tmp_path, batch_size=64, shuffle_buffer=500, world_size=1, rank=0):
        for row_id, row in zip(batch["id"].tolist(), batch["v"], strict=True):
            width = (3, 4, 3, 5)[row_id // 300]
            assert [float(x) for x in row] == [float(row_id)] * width
            seen.append(row_id)
    assert sorted(seen) == list(range(1200))
    assert seen != sorted(seen)  # shuffled


@pytest.mark.parametrize("workers", [0, 2])
def test_shuffled_rows_of_every_width_and_type_keep_their_values(
    tmp_path: Path, workers: int
) -> None:
    """Rows are copied to their shuffled places as wider elements where their bytes allow (a
    row of 12 bytes as 3 int32, of 32 as 2 complex128): each row still holds its own values."""
    kinds = {"u3": (np.uint8, 3), "u12": (np.uint8, 12), "i5": (np.int16, 5)}
    kinds |= {"f8": (np.float32, 8), "d3": (np.float64, 3), "b7": (np.bool_, 7)}
    kinds |= {"nan": (np.uint8, 16)}  # each 8 bytes a signalling NaN's bits: copied bit for bit

    def values(kind: Any, width: int, ids: np.ndarray) -> np.ndarray:
        grid = ids[:, None] * 7 + np.arange(width)[None, :]
        if width == 16:
            grid[:, [6, 7, 14, 15]] = [0xF0, 0x7F, 0xF0, 0xFF]
        return (grid % 2 == 0) if kind is np.bool_ else (grid % 256).astype(kind)

    ids = np.arange(3000)
    columns = {
        name: pa.FixedSizeListArray.from_arrays(pa.array(values(k, w, ids).ravel()), w)
        for name, (k, w) in kinds.items()
    }
    columns["none"] = pa.array([[]] * len(ids), pa.list_(pa.int64()))  # rows of no values
    pq.write_table(pa.table({"id": ids, **columns}), tmp_path / "k.parquet", row_group_size=700)
    ds = from_parquet(tmp_path, batch_size=128, shuffle_buffer=1000, world_size=1, rank=0)
    seen = []
    for batch in ds if workers == 0 else ds.loader(workers):
        got = batch["id"].numpy()
        for name, (kind, width) in kinds.items():
            assert np.array_equal(batch[name].numpy(), values(kind, width, got)), name
        assert batch["none"].shape == (len(got), 0)
        seen += got.tolist()
    assert sorted(seen) == ids.tolist() and seen != sorted(seen)


def test_worker_turns_are_inverted() -> None:
    counts = [5, 5, 4]
    for consumed in range(sum(counts) + 1):
        taken, turn = data_order.split_consumed(consumed, counts)
        order = [w for r in range(5) for w in range(3) if counts[w] > r][:consumed]
        assert taken == [order.count(w) for w in range(3)]
        rest = [w for r in range(5) for w in range(3) if counts[w] > r][consumed:]
        assert turn == (rest[0] if rest else 0)


def test_rows_mode_and_loader_batches(tmp_path: Path) -> None:
    path = write_ids(tmp_path / "data")
    rows = from_parquet(path, batch_size=None, world_size=1, shuffle=False)
    first = next(iter(rows))
    assert first["id"].dim() == 0 and first["x"].shape == (2,)
    loader = rows.loader(batch_size=100)
    assert [len(b["id"]) for b in loader][-1] == ROWS % 100 and len(loader) == 11


def test_transform_and_text_columns(tmp_path: Path) -> None:
    table = pa.table({"text": ["a", "bb", "ccc", "dddd"], "n": [1, 2, 3, 4]})
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(ConfigError, match=r"'text'.*transform="):
        from_parquet(tmp_path / "t.parquet", world_size=1)

    def lengths(batch: dict[str, Any]) -> torch.Tensor:
        return torch.tensor([len(t) for t in batch["text"]]) * batch["n"]

    dataset = from_parquet(
        tmp_path / "t.parquet", batch_size=4, world_size=1, shuffle=False, transform=lengths
    )
    assert next(iter(dataset)).tolist() == [1, 4, 9, 16]


def test_variable_lists_and_vectors(tmp_path: Path) -> None:
    vector = pa.struct(
        [
            ("type", pa.int8()),
            ("size", pa.int32()),
            ("indices", pa.list_(pa.int32())),
            ("values", pa.list_(pa.float64())),
        ]
    )
    table = pa.table(
        {
            "ragged": pa.array([[1.0], [2.0, 3.0], [], [4.0, 5.0, 6.0]], pa.list_(pa.float32())),
            "vec": pa.array(
                [
                    {"type": 1, "size": None, "indices": None, "values": [1.0, 2.0, 3.0]},
                    {"type": 0, "size": 3, "indices": [2], "values": [9.0]},
                    {"type": 0, "size": 3, "indices": [0, 1], "values": [7.0, 8.0]},
                    {"type": 1, "size": None, "indices": None, "values": [4.0, 5.0, 6.0]},
                ],
                vector,
            ),
        }
    )
    pq.write_table(table, tmp_path / "v.parquet")
    batch = next(
        iter(from_parquet(tmp_path / "v.parquet", batch_size=4, world_size=1, shuffle=False))
    )
    assert [t.tolist() for t in batch["ragged"]] == [[1.0], [2.0, 3.0], [], [4.0, 5.0, 6.0]]
    assert batch["vec"].tolist() == [[1, 2, 3], [0, 0, 9], [7, 8, 0], [4, 5, 6]]


def test_bad_inputs_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no Parquet files at"):
        from_parquet(tmp_path / "missing")
    pq.write_table(
        pa.table({"m": pa.array([{"a": 1}], pa.map_(pa.string(), pa.int64()))}),
        tmp_path / "map.parquet",
    )
    with pytest.raises(ConfigError, match="column 'm' of type map"):
        from_parquet(tmp_path / "map.parquet")
    (tmp_path / "empty").mkdir()
    pq.write_table(pa.table({"a": pa.array([], pa.int64())}), tmp_path / "empty" / "e.parquet")
    with pytest.raises(ConfigError, match="holds no rows"):
        from_parquet(tmp_path / "empty")
    pq.write_table(pa.table({"a": [1, 2]}), tmp_path / "two.parquet")
    with pytest.raises(ConfigError, match="2 rows but the run has 3 ranks"):
        list(from_parquet(tmp_path / "two.parquet", rank=0, world_size=3))
    pq.write_table(pa.table({"a": [1, None, 3]}), tmp_path / "null.parquet")
    with pytest.raises(ConfigError, match=r"column .a. is null at row 1 of .*null\.parquet"):
        list(from_parquet(tmp_path / "null.parquet", world_size=1, shuffle=False))
    with pytest.raises(ConfigError, match=r"columns \['nope'\] are not in the data"):
        from_parquet(tmp_path / "two.parquet", columns=["nope"])
    for bad in ({"batch_size": 0}, {"uneven": "wrap"}, {"shuffle_buffer": -1}):
        with pytest.raises(ConfigError, match=str(next(iter(bad)))):
            from_parquet(tmp_path / "two.parquet", **bad)


def test_glob_and_file_url(tmp_path: Path) -> None:
    path = write_ids(tmp_path / "data")
    (path / "_SUCCESS").write_text("")
    assert from_parquet(f"{path}/part-[01].parquet").source.rows < ROWS
    assert from_parquet(f"file://{path}").source.rows == ROWS


def test_delta_versions_and_partitions(tmp_path: Path) -> None:
    deltalake = pytest.importorskip("deltalake")
    table = str(tmp_path / "delta")
    deltalake.write_deltalake(
        table, pa.table({"id": np.arange(10), "part": ["a"] * 5 + ["b"] * 5}), partition_by=["part"]
    )
    time.sleep(0.05)  # the two commits get different timestamps (milliseconds)
    deltalake.write_deltalake(
        table, pa.table({"id": np.arange(10, 15), "part": ["c"] * 5}), mode="append"
    )
    options: dict[str, Any] = {"batch_size": 100, "world_size": 1, "transform": lambda b: b}
    latest = from_delta(table, **options)
    first = from_delta(table, version=0, **options)
    assert latest.source.rows == 15 and first.source.rows == 10
    rows = next(iter(latest))
    assert sorted(zip(rows["id"].tolist(), rows["part"], strict=True))[::5] == [
        (0, "a"),
        (5, "b"),
        (10, "c"),
    ]
    history = {h["version"]: h["timestamp"] for h in deltalake.DeltaTable(table).history()}
    between = datetime.fromtimestamp((history[0] + history[1]) / 2000, tz=timezone.utc)
    assert from_delta(table, timestamp=between, **options).source.rows == 10
    with pytest.raises(ConfigError, match="version=0 or timestamp"):
        from_delta(table, version=0, timestamp="2020-01-01T00:00:00Z")


# -- inside real ranks --------------------------------------------------------------------------


def _train(path: str, out: str, workers: int, kill_at: int) -> int:
    """Two epochs; each step saves the data state, and writes its batch's ids to a file."""
    import torch.distributed as dist

    from sparktrain import checkpoint
    from sparktrain.contract.env import restart_count

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dataset = from_parquet(path, batch_size=16, shuffle_buffer=64)
    loader = dataset.loader(num_workers=workers)
    saved = checkpoint.load_latest(out)
    step = 0
    if saved is not None:
        dataset.load_state_dict(saved.state["data"][rank])
        step = saved.step
    while dataset.epoch < 2:
        for batch in loader:
            step += 1
            total = torch.tensor([len(batch["id"])])
            dist.all_reduce(total)  # a rank that ran out would hang here
            Path(out, "log", f"step-{step}-rank-{rank}").write_text(repr(batch["id"].tolist()))
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, dataset.state_dict())
            checkpoint.save({"data": states}, out, step=step)
            if step == kill_at and rank == 1 and restart_count() == 0:
                os.kill(os.getpid(), signal.SIGKILL)
    return step


def _steps(out: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in (out / "log").iterdir()}


@pytest.mark.parametrize("workers", [0, 2])
def test_sigkilled_run_resumes_the_same_samples(tmp_path: Path, workers: int) -> None:
    path = write_ids(tmp_path / "data", rows=203, files=2, group=29)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    (straight / "log").mkdir(parents=True), (killed / "log").mkdir(parents=True)
    steps = launch(_train, (str(path), str(straight), workers, 0), num_processes=2).value
    result = launch(
        _train, (str(path), str(killed), workers, 9), num_processes=2, max_restarts=1, timeout=120
    )
    per_epoch = 7 if workers == 0 else 8  # 102 rows a rank: 7 batches of 16, or 2 x 4 of 51
    assert result.attempts == 2 and result.value == steps == 2 * per_epoch
    assert len(_steps(killed)) == 2 * steps and _steps(killed) == _steps(straight)


def test_stream_parquet_example(examples_on_path: Path) -> None:
    import stream_parquet

    result = stream_parquet.main(["--rows", "2000", "--epochs", "1", "--kill-at", "5"])
    assert result.attempts == 2 and 0 < result.value < 3  # resumed after rank 1's SIGKILL


def _lightning_ids(path: str, root: str) -> list[int]:
    """Fit a LightningModule on the stream; the ids this rank trained on."""
    import lightning as L
    from torch import nn

    seen: list[int] = []

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(2, 1)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            seen.extend(batch["id"].tolist())
            return self.net(batch["x"]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Probe(), from_parquet(path, batch_size=32).loader())
    return seen


def test_lightning_trains_on_the_stream(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    path = write_ids(tmp_path / "data")
    result = launch(_lightning_ids, (str(path), str(tmp_path)), num_processes=2, return_all=True)
    shares = result.return_values
    assert len(shares[0]) == len(shares[1]) == 501  # 1001 rows: one repeated to even the ranks
    assert set(shares[0]) | set(shares[1]) == set(range(ROWS))


def _hf_losses(path: str, root: str) -> tuple[float, float]:
    """A tiny BERT trained by ``transformers.Trainer`` on rows streamed from Parquet."""
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    # Accelerate reads an IterableDataset on rank 0 and hands each rank its part of every
    # batch (dispatch_batches): rank 0 reads the whole stream, hence world_size=1.
    rows = from_parquet(path, batch_size=None, world_size=1, rank=0)
    config = BertConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    table = pq.read_table(path)
    ids = torch.tensor(table["input_ids"].to_pylist())
    labels = torch.tensor(table["labels"].to_pylist())

    def loss() -> float:
        with torch.no_grad():
            return float(model(input_ids=ids, labels=labels).loss)

    before = loss()
    args = TrainingArguments(
        output_dir=root,
        max_steps=15,
        per_device_train_batch_size=8,
        learning_rate=5e-3,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=rows).train()
    model.eval()
    return before, loss()


def test_hf_trainer_trains_on_the_stream(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (128, 8), generator=g)
    table = pa.table(
        {
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.flatten().numpy()), 8),
            "labels": (ids[:, 0] >= 16).long().numpy(),
        }
    )
    pq.write_table(table, tmp_path / "rows.parquet")
    before, after = launch(
        _hf_losses, (str(tmp_path / "rows.parquet"), str(tmp_path)), num_processes=2
    ).value
    assert after < before
