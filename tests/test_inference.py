"""Batch inference over files on this machine (no Spark): ``sparktrain.inference.score``.

Real ranks read real Parquet files and write real output parts; every check compares the output
with the model's own forward pass, row by row, matched by id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from conftest import alive, descendants, wait_gone
from sparktrain import ConfigError, TrainingFailedError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from sparktrain.inference import score  # noqa: E402
from sparktrain.inference.rank.parts import plan_parts  # noqa: E402

WIDTH = 8


def write_features(folder: Path, files: int = 3, rows: int = 2000, group: int = 500) -> Path:
    """``files`` Parquet files of ``rows`` rows each: ``id`` and ``x`` (WIDTH float32)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for index in range(files):
        values = rng.standard_normal(rows * WIDTH, dtype=np.float32)
        offsets = pa.array(np.arange(0, rows * WIDTH + 1, WIDTH, dtype=np.int32))
        table = pa.table(
            {
                "id": pa.array(np.arange(index * rows, (index + 1) * rows, dtype=np.int64)),
                "x": pa.ListArray.from_arrays(offsets, pa.array(values)),
            }
        )
        pq.write_table(table, folder / f"f{index}.parquet", row_group_size=group)
    return folder


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 16), nn.ReLU(), nn.Linear(16, 3)).eval()


def check_output(output: Path, data: Path, model: nn.Module, column: str = "prediction") -> None:
    """Every input row has exactly one output row, equal to the model's own forward pass."""
    scored = pq.read_table(output)
    ids = scored.column("id").to_numpy()
    assert len(ids) == len(set(ids.tolist())), "a row was written twice"
    source = pq.read_table(data).sort_by("id")
    assert sorted(ids.tolist()) == source.column("id").to_pylist(), "rows lost or added"
    order = np.argsort(ids)
    got = np.stack(scored.column(column).to_numpy(zero_copy_only=False))[order]
    x = torch.from_numpy(np.stack(source.column("x").to_numpy(zero_copy_only=False)))
    with torch.inference_mode():
        expected = model(x).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_parts_are_whole_row_groups_in_order() -> None:
    from sparktrain.data.sources import Source, Unit

    units = tuple(Unit(f"f{i // 3}", i % 3, 100) for i in range(7))
    parts = plan_parts(Source("s", units, None, None), 250)
    assert [p.units for p in parts] == [(0, 1, 2), (3, 4, 5), (6,)]
    assert [p.starts for p in parts] == [(0, 100, 200), (0, 100, 200), (0,)]
    assert [p.rows for p in parts] == [300, 300, 100]


def test_score_writes_every_row_once(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    data = write_features(tmp_path / "in")
    model = make_model()
    result = score(
        data, model, output=tmp_path / "out", input_cols="x", keep_cols="id",
        rows_per_part=1000, num_processes=2,
    )  # fmt: skip
    assert (result.parts, result.rows, result.scored_parts) == (6, 6000, 6)
    assert 0 < result.scoring_seconds < result.seconds  # the ranks' start-up is not scoring
    check_output(tmp_path / "out", data, model)
    names = sorted(os.listdir(tmp_path / "out"))
    assert names == ["_SUCCESS", "_sparktrain_scoring.json"] + [
        f"part-{i:05d}.parquet" for i in range(6)
    ]
    assert "6 parts (6,000 rows)" in capfd.readouterr().err
    again = score(data, model, output=tmp_path / "out", input_cols="x", keep_cols="id",
                  rows_per_part=1000, num_processes=2)  # fmt: skip
    assert (again.scored_parts, again.rows) == (0, 6000)  # finished: nothing is scored again
    assert again.scoring_seconds == 0.0


CALLER = """
import sys, time, torch
from torch import nn
from sparktrain.inference import score

class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).eval()

    def forward(self, x):
        time.sleep(0.05)
        return self.inner(x)

score(sys.argv[1], Slow(), output=sys.argv[2], input_cols="x", keep_cols="id",
      rows_per_part=500, batch_size=100, num_processes=2)
"""


def test_a_scoring_killed_half_way_resumes_without_redoing_parts(tmp_path: Path) -> None:
    data = write_features(tmp_path / "in")
    out = tmp_path / "out"
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, str(data), str(out)], start_new_session=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and caller.poll() is None:
        written = [n for n in os.listdir(out) if n.startswith("part-")] if out.exists() else []
        if len(written) >= 3:
            break
        time.sleep(0.05)
    assert caller.poll() is None, "the scoring ended before it could be killed"
    family = descendants(caller.pid)
    caller.send_signal(signal.SIGKILL)
    caller.wait(timeout=30)
    assert wait_gone(family, within=20) == [], "the killed caller's ranks outlived it"
    done_before = {n for n in os.listdir(out) if n.startswith("part-")}
    assert 3 <= len(done_before) < 12
    namespace: dict[str, Any] = {}
    exec(CALLER.split("score(sys.argv", maxsplit=1)[0], namespace)  # the same model class, here
    model = namespace["Slow"]()
    result = score(
        data, model, output=out, input_cols="x", keep_cols="id", rows_per_part=500,
        batch_size=100, num_processes=2,
    )  # fmt: skip
    assert result.scored_parts == 12 - len(done_before)
    assert not [n for n in os.listdir(out) if n.startswith(".")], "a temporary part was left"
    check_output(out, data, model.inner)


def _crash_once(marker: str) -> Any:
    def preprocess(table: Any) -> Any:
        crashed = Path(marker)
        if "RANK" in os.environ and not crashed.exists():  # in a rank, not the driver's sample
            crashed.write_text("crashed")
            os._exit(3)
        column = table.column("x").combine_chunks()
        return torch.from_numpy(column.flatten().to_numpy().copy()).reshape(len(column), WIDTH)

    return preprocess


def scored_through_a_crash(tmp_path: Path, **launch: Any) -> None:
    """A rank dies on its first part; the restarted run skips written parts, loses no row."""
    data = write_features(tmp_path / "in")
    model = make_model()
    result = score(
        data, model, output=tmp_path / "out", input_cols="x", keep_cols="id",
        preprocess=_crash_once(str(tmp_path / "marker")), rows_per_part=1000,
        num_processes=2, max_restarts=1, **launch,
    )  # fmt: skip
    assert (result.parts, result.rows) == (6, 6000)
    assert (tmp_path / "marker").exists()  # a rank did die, and the run survived it
    check_output(tmp_path / "out", data, model)


def test_a_rank_that_dies_is_restarted_and_skips_written_parts(tmp_path: Path) -> None:
    scored_through_a_crash(tmp_path)


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    data = write_features(tmp_path / "in", files=1)
    model = make_model()
    with pytest.raises(ConfigError, match=r"input_cols \['y'\] not in .*'id', 'x'"):
        score(data, model, output=tmp_path / "o1", input_cols="y")
    with pytest.raises(ConfigError, match=r"keep_cols \['nope'\]"):
        score(data, model, output=tmp_path / "o1", input_cols="x", keep_cols="nope")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"a\.parquet' is not a readable Parquet file"):
        score(tmp_path / "junk", model, output=tmp_path / "o2", input_cols="x")
    with pytest.raises(ConfigError, match="autocast='fp8' must be None, 'bf16' or 'fp16'"):
        score(data, model, output=tmp_path / "o3", input_cols="x", autocast="fp8")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "other.txt").write_text("x")
    with pytest.raises(
        ConfigError, match=r"holds files that are not a scoring's \(\['other.txt'\]\)"
    ):
        score(data, model, output=tmp_path / "full", input_cols="x", overwrite=True)
    assert (tmp_path / "full" / "other.txt").exists()  # overwrite deletes only a scoring's files
    for inside in (data, data / "scores"):
        with pytest.raises(ConfigError, match="one folder or one inside the other"):
            score(data, model, output=inside, input_cols="x")
    with pytest.raises(ConfigError, match="one result per input row"):
        score(data, lambda x: x.sum(), output=tmp_path / "o4", input_cols="x")


def test_a_null_and_a_wrong_length_name_the_file_and_row(tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    rows = [[0.5] * WIDTH] * 700
    nulls = [*rows[:612], None, *rows[613:]]
    short = [*rows[:655], [0.5] * 3, *rows[656:]]
    for name, values in (("nulls", nulls), ("short", short)):
        table = pa.table({"id": np.arange(700), "x": pa.array(values, pa.list_(pa.float32()))})
        pq.write_table(table, folder / f"{name}.parquet", row_group_size=300)
        with pytest.raises(TrainingFailedError) as caught:
            score(folder / f"{name}.parquet", make_model(), output=tmp_path / f"o-{name}",
                  input_cols="x", keep_cols="id", num_processes=1)  # fmt: skip
        text = str(caught.value)
        assert f"{name}.parquet" in text
        if name == "nulls":
            assert "column 'x' is null at row 612 of" in text
        else:
            assert "column 'x' has 3 values at row 655 of" in text


def test_another_scoring_is_not_resumed_into_the_same_folder(tmp_path: Path) -> None:
    data = write_features(tmp_path / "in", files=1)
    score(data, make_model(), output=tmp_path / "out", input_cols="x", num_processes=1)
    other = nn.Linear(WIDTH, 2)
    with pytest.raises(ConfigError, match=r"it differs in \['model', 'output'\]"):
        score(data, other, output=tmp_path / "out", input_cols="x", num_processes=1)
    result = score(data, other, output=tmp_path / "out", input_cols="x", num_processes=1,
                   overwrite=True)  # fmt: skip
    assert result.scored_parts == 1
    manifest = json.loads((tmp_path / "out" / "_sparktrain_scoring.json").read_text())
    assert manifest["format"] == "parquet"


class _Tokens(nn.Module):
    """A model with keyword inputs, as a Hugging Face model takes them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(128, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, Any]:
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return {"logits": self.head(pooled), "length": attention_mask.sum(1)}


def tokenise(table: Any) -> dict[str, torch.Tensor]:
    texts = table.column("text").to_pylist()
    longest = max(len(t) for t in texts)
    ids = torch.zeros(len(texts), longest, dtype=torch.long)
    mask = torch.zeros(len(texts), longest, dtype=torch.long)
    for row, text in enumerate(texts):
        ids[row, : len(text)] = torch.tensor([ord(c) % 128 for c in text])
        mask[row, : len(text)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def test_preprocess_feeds_keyword_inputs_by_tokens(tmp_path: Path) -> None:
    texts = [f"row {i} " + "word " * (i % 7) for i in range(300)]
    pq.write_table(pa.table({"id": np.arange(300), "text": texts}), tmp_path / "t.parquet")
    model = _Tokens().eval()
    result = score(
        tmp_path / "t.parquet", model, output=tmp_path / "out", input_cols="text",
        keep_cols="id", preprocess=tokenise, batch_size=64, batch_tokens=200, num_processes=1,
    )  # fmt: skip
    assert result.rows == 300
    scored = pq.read_table(tmp_path / "out").sort_by("id")
    with torch.inference_mode():  # padding differs by batch; the masked mean does not
        expected = model(**tokenise(pa.table({"text": texts})))
    got = np.stack([r["logits"] for r in scored.column("prediction").to_pylist()])
    np.testing.assert_allclose(got, expected["logits"].numpy(), rtol=1e-5, atol=1e-5)
    lengths = [r["length"] for r in scored.column("prediction").to_pylist()]
    assert lengths == [len(t) for t in texts]


def test_autocast_bf16_scores_in_half_precision(tmp_path: Path) -> None:
    data = write_features(tmp_path / "in", files=1)
    model = make_model()
    score(data, model, output=tmp_path / "out", input_cols="x", keep_cols="id",
          autocast="bf16", num_processes=1)  # fmt: skip
    scored = pq.read_table(tmp_path / "out").sort_by("id")
    assert scored.schema.field("prediction").type == pa.list_(pa.float32())
    got = np.stack(scored.column("prediction").to_numpy(zero_copy_only=False))
    x = torch.from_numpy(np.stack(pq.read_table(data).sort_by("id")["x"].to_numpy(False)))
    with torch.inference_mode():
        exact = model(x).numpy()
    assert not np.array_equal(got, exact)  # bf16 arithmetic really ran
    np.testing.assert_allclose(got, exact, atol=0.1)


def test_delta_in_and_delta_out(tmp_path: Path) -> None:
    deltalake = pytest.importorskip("deltalake")
    data = write_features(tmp_path / "in", files=2)
    deltalake.write_deltalake(str(tmp_path / "table"), pq.read_table(data))
    model = make_model()
    result = score(
        tmp_path / "table", model, output=tmp_path / "out", input_cols="x", keep_cols="id",
        format="delta", rows_per_part=1500, num_processes=2,
    )  # fmt: skip
    assert result.rows == 4000
    table = deltalake.DeltaTable(str(tmp_path / "out"))
    assert table.version() == 0 and len(table.file_uris()) == result.parts
    written = table.to_pyarrow_table()
    pq.write_table(written, tmp_path / "delta-out.parquet")
    check_output(tmp_path / "delta-out.parquet", data, model)


def test_an_mlflow_uri_is_scored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking._tracking_service import utils

    # set_tracking_uri writes a module global and MLFLOW_TRACKING_URI: both undone at the end,
    # or later tests' runs (test_spark's tracking test) would be logged into this store.
    monkeypatch.setattr(utils, "_tracking_uri", None)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = write_features(tmp_path / "in", files=1)
    model = make_model()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with mlflow.start_run():
        info = mlflow.pytorch.log_model(model, name="model", serialization_format="pickle")
    score(data, info.model_uri, output=tmp_path / "out", input_cols="x", keep_cols="id",
          num_processes=1)  # fmt: skip
    check_output(tmp_path / "out", data, model)


def test_no_rank_outlives_a_scoring(tmp_path: Path) -> None:
    data = write_features(tmp_path / "in", files=1)
    before = descendants(os.getpid())
    score(data, make_model(), output=tmp_path / "out", input_cols="x", num_processes=2)
    import sparktrain

    sparktrain.shutdown_warm()
    left = [p for p in descendants(os.getpid()) - before if alive(p)]
    assert wait_gone(left, within=10) == []


def test_row_groups_the_filter_rules_out_are_not_read(tmp_path: Path) -> None:
    import pyarrow.compute as pc

    from sparktrain.inference.planning import as_source
    from sparktrain.inference.rank.reading import _may_match

    data = write_features(tmp_path / "in", files=2)
    source = as_source(data)

    class Plan:  # the two fields _may_match reads
        row_filter = (pc.field("id") >= 2400) & (pc.field("id") < 2600)

    Plan.source = source  # type: ignore[attr-defined]
    first, second = sorted({u.file for u in source.units})
    assert _may_match(Plan, first) == set()  # type: ignore[arg-type]
    assert _may_match(Plan, second) == {0, 1}  # type: ignore[arg-type]  # ids 2000-2999


def test_the_score_files_example(examples_on_path: Path, tmp_path: Path) -> None:
    import score_files

    first = score_files.main(["--rows", "30000", "--work", str(tmp_path)])
    assert (first.rows, first.parts, first.scored_parts) == (30_000, 3, 3)
    again = score_files.main(["--rows", "30000", "--work", str(tmp_path)])
    assert (again.rows, again.scored_parts) == (30_000, 0)  # every part was written: none again


def test_a_hugging_face_model_with_a_tokenising_preprocess(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    texts = [f"review {i}: " + "fine " * (i % 9) for i in range(200)]
    pq.write_table(pa.table({"id": np.arange(200), "text": texts}), tmp_path / "t.parquet")
    score(tmp_path / "t.parquet", model, output=tmp_path / "out", input_cols="text",
          keep_cols="id", preprocess=tokenise, batch_size=50, batch_tokens=400,
          num_processes=1)  # fmt: skip
    scored = pq.read_table(tmp_path / "out").sort_by("id")
    got = np.stack([r["logits"] for r in scored.column("prediction").to_pylist()])
    with torch.inference_mode():  # one batch, padded to the longest text of all
        expected = model(**tokenise(pa.table({"text": texts}))).logits.numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_a_model_with_batch_norm_and_its_identity(tmp_path: Path) -> None:
    from sparktrain.inference.models import model_identity

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 4), nn.BatchNorm1d(4)).eval()  # a 0-dim counter
    same = nn.Sequential(nn.Linear(WIDTH, 4), nn.BatchNorm1d(4)).eval()
    same.load_state_dict(model.state_dict())
    assert model_identity(model, b"a") == model_identity(same, b"b")  # weights, not pickles
    with torch.no_grad():
        same[1].running_mean += 1
    assert model_identity(model, b"a") != model_identity(same, b"a")
    data = write_features(tmp_path / "in", files=1)
    score(data, model, output=tmp_path / "out", input_cols="x", keep_cols="id", num_processes=1)
    check_output(tmp_path / "out", data, model)


def test_gpu_choice_and_default_ranks_follow_the_gpus_the_launch_sees(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Faked discovery, the real launch path: one GPU seen, so by default one rank scores;
    ``use_gpu=False`` runs more ranks than GPUs on the CPU instead of being refused."""
    from sparktrain.launchplan.topology import Topology

    data = write_features(tmp_path / "in")
    model = make_model()
    one_gpu = Topology(cpus=2, gpus=("0",), hostname="h")
    score(data, model, output=tmp_path / "gpu", input_cols="x", keep_cols="id",
          rows_per_part=1000, topology=one_gpu)  # fmt: skip
    assert "by 1 rank(s) on local" in capfd.readouterr().err
    check_output(tmp_path / "gpu", data, model)
    result = score(
        data, model, output=tmp_path / "cpu", input_cols="x", keep_cols="id",
        rows_per_part=1000, num_processes=2, use_gpu=False, topology=one_gpu,
    )  # fmt: skip
    assert "by 2 rank(s) on local" in capfd.readouterr().err
    assert result.scored_parts == 6
    check_output(tmp_path / "cpu", data, model)


def test_a_fixed_size_list_column_is_scored(tmp_path: Path) -> None:
    """Arrays written as Arrow's fixed-size lists (numpy and many embedding tools do) have no
    offsets: they are read as rows of one width."""
    folder = tmp_path / "in"
    folder.mkdir()
    values = np.random.default_rng(1).standard_normal(3000 * WIDTH, dtype=np.float32)
    table = pa.table(
        {
            "id": pa.array(np.arange(3000, dtype=np.int64)),
            "x": pa.FixedSizeListArray.from_arrays(pa.array(values), WIDTH),
        }
    )
    pq.write_table(table, folder / "f.parquet", row_group_size=1000)
    model = make_model()
    score(folder, model, output=tmp_path / "out", input_cols="x", keep_cols="id",
          num_processes=1)  # fmt: skip
    check_output(tmp_path / "out", folder, model)
