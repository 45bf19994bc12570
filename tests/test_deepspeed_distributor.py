"""DeepspeedTorchDistributor: pyspark's signature, configs that reach every rank, early errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import sparktrain
from sparktrain import ConfigError, DeepspeedTorchDistributor

pytest.importorskip("deepspeed")

CONFIG = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}


def deepspeed_train(steps: int) -> dict:
    """A function-mode DeepSpeed training that reads its config from the distributor."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    config = sparktrain.deepspeed_config()
    assert config is not None
    config["zero_force_ds_cpu_optimizer"] = False
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return {"stage": engine.zero_optimization_stage(), "losses": losses}


def test_function_mode_with_dict_and_file(tmp_path: Path) -> None:
    result = DeepspeedTorchDistributor(2, 1, True, False, CONFIG).run(deepspeed_train, 5)
    assert result["stage"] == 2 and result["losses"][-1] < result["losses"][0]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**CONFIG, "zero_optimization": {"stage": 1}}))
    assert (
        DeepspeedTorchDistributor(2, 1, True, False, str(path)).run(deepspeed_train, 2)["stage"]
        == 1
    )


SCRIPT = """
import argparse, json, os, sys
parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int)
parser.add_argument("--deepspeed", action="store_true")
parser.add_argument("--deepspeed_config")
args = parser.parse_args()
config = json.load(open(args.deepspeed_config))
out = os.path.join(os.environ["OUT"], os.environ["RANK"])
open(out, "w").write(json.dumps({"epochs": args.epochs, "deepspeed": args.deepspeed,
                                 "stage": config["zero_optimization"]["stage"],
                                 "path": args.deepspeed_config}))
"""


def test_script_mode_gets_the_flags_and_the_file_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    monkeypatch.setenv("OUT", str(tmp_path))
    DeepspeedTorchDistributor(2, 1, True, False, CONFIG).run(str(script), "--epochs", 3)
    for rank in ("0", "1"):
        seen = json.loads((tmp_path / rank).read_text())
        assert seen["epochs"] == 3 and seen["deepspeed"] is True and seen["stage"] == 2
        assert not os.path.exists(seen["path"])  # the private config file is gone


@pytest.mark.parametrize(
    ("config", "pattern"),
    [
        ("missing.json", r"deepspeedConfig='missing\.json' is not an existing file"),
        (42, r"deepspeedConfig=42 \(int\) must be a dict"),
        ({"f": object()}, r"cannot be written as JSON"),
    ],
)
def test_bad_configs_fail_before_launch(config: object, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        DeepspeedTorchDistributor(2, 1, True, False, config)  # type: ignore[arg-type]


def test_invalid_json_and_bad_layout(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{stage: 3")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        DeepspeedTorchDistributor(2, 1, True, False, str(bad))
    with pytest.raises(ConfigError, match="nnodes=2 with localMode=True"):
        DeepspeedTorchDistributor(1, 2, True, False)
    with pytest.raises(ConfigError, match="numGpus=0"):
        DeepspeedTorchDistributor(0)


def test_tracked_deepspeed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking._tracking_service import utils

    monkeypatch.setattr(utils, "_tracking_uri", None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    DeepspeedTorchDistributor(2, 1, True, False, CONFIG, mlflow=True).run(deepspeed_train, 2)
    (run,) = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_runs(["0"])
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
