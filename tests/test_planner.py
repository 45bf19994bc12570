"""The memory planner's arithmetic: the seeds' and the ZeRO paper's worked cases, and its inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparktrain.cli import main
from sparktrain.ground.errors import ConfigError
from sparktrain.planner import (
    STRATEGIES,
    Activations,
    advise_cluster,
    model_size,
    plan,
)
from sparktrain.planner.bytemodel import byte_model
from sparktrain.planner.units import format_bytes, parse_bytes, parse_count

GB = 10**9

# Llama 2 configs (the fields of their config.json) and their published parameter counts.
LLAMA2 = {
    "7B": (dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                intermediate_size=11008), 6_738_415_616),
    "13B": (dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
                 intermediate_size=13824), 13_015_864_320),
    "70B": (dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, intermediate_size=28672), 68_976_648_192),
}  # fmt: skip


def llama2(name: str) -> dict[str, object]:
    fields, _ = LLAMA2[name]
    return {
        **fields,
        "vocab_size": 32000,
        "hidden_act": "silu",
        "model_type": "llama",
        "tie_word_embeddings": False,
    }


def gb(nbytes: int) -> float:
    return round(nbytes / GB, 1)


# --- the seeds' worked cases -------------------------------------------------------------


def test_13b_on_4_a100_80gb_recommends_zero3() -> None:
    p = plan("13B", gpus_per_node=4, gpu_memory="80GB")
    ddp, zero1, zero2, zero3 = (p.estimate(s) for s in ("ddp", "zero1", "zero2", "zero3"))
    assert ddp.memory.gpu_total == 208 * GB and not ddp.fits
    assert zero1.memory.gpu_total == 91 * GB and not zero1.fits
    assert zero2.memory.gpu_total == 71.5 * GB and zero2.fits and not zero2.fits_with_headroom
    assert zero3.memory.gpu_total == 52 * GB and zero3.fits_with_headroom
    assert p.recommended == "zero3"
    assert "ddp needs 208 GB per GPU, more than the 80.0 GB" in p.reasons[0]
    assert any("zero3 needs 52.0 GB per GPU (65% of 80.0 GB)" in r for r in p.reasons)


def test_70b_on_8_a100_80gb_fits_only_with_zero3_offload() -> None:
    p = plan("70B", gpus_per_node=8, gpu_memory="80GB")
    fitting = [e.strategy for e in p.estimates if e.fits]
    assert fitting == ["zero3_offload", "zero3_offload_params"]
    assert p.recommended == "zero3_offload"
    offload = p.estimate("zero3_offload").memory
    assert offload.gpu_total == 17.5 * GB  # bf16 parameter shard: 2 * 70B / 8
    assert offload.cpu_per_node == 16 * 70 * GB  # fp32 master + moments + fp32 grads
    assert p.estimate("zero3_offload_params").memory.cpu_per_node == 18 * 70 * GB
    assert p.estimate("zero3").memory.gpu_total == 140 * GB
    assert any("1.12 TB" in r and "cpu_memory=" in r for r in p.reasons)


def test_70b_offload_checks_the_cpu_memory_when_given() -> None:
    roomy = plan("70B", gpus_per_node=8, gpu_memory="80GB", cpu_memory="2TB")
    assert roomy.recommended == "zero3_offload"
    assert roomy.estimate("zero3_offload").fits_with_headroom
    tight = plan("70B", gpus_per_node=8, gpu_memory="80GB", cpu_memory="1152GiB")
    assert tight.recommended == "zero3_offload"
    assert not tight.estimate("zero3_offload").fits_with_headroom
    assert not tight.estimate("zero3_offload_params").fits  # 1.26 TB > 1.24 TB
    assert "CPU memory per node leaves little" in tight.reasons[-3]
    small = plan("70B", gpus_per_node=8, gpu_memory="80GB", cpu_memory="512GB")
    assert small.recommended is None
    assert "Nothing fits" in small.reasons[-1] and "more CPU memory" in small.reasons[-1]
    assert any("1.12 TB of CPU memory per node, more than" in r for r in small.reasons)


def test_70b_on_two_nodes_halves_the_cpu_per_node() -> None:
    p = plan("70B", gpus_per_node=8, nodes=2, gpu_memory="80GB")
    assert p.world_size == 16
    assert p.estimate("zero3_offload").memory.cpu_per_node == 8 * 70 * GB
    assert p.estimate("zero3").memory.gpu_total == 70 * GB  # fits, but not with 20 % headroom
    assert p.recommended == "zero3_offload"


def test_zero_paper_figure_7_5b_on_64_gpus() -> None:
    p = plan("7.5B", gpus_per_node=8, nodes=8, gpu_memory="32GB")
    per_gpu = [gb(p.estimate(s).memory.gpu_total) for s in ("ddp", "zero1", "zero2", "zero3")]
    assert per_gpu == [120.0, 31.4, 16.6, 1.9]


# --- the byte model ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "optimizer", "p", "g", "k"),
    [
        ("bf16-mixed", "adam", 2, 2, 12),
        ("fp16-mixed", "adamw", 2, 2, 12),
        ("fp32", "adam", 4, 4, 8),
        ("bf16-mixed", "sgd", 2, 2, 4),
        ("bf16-mixed", "sgd-momentum", 2, 2, 8),
        ("fp32", "sgd", 4, 4, 0),
        ("fp32", "sgd-momentum", 4, 4, 4),
    ],
)
def test_byte_model(precision: str, optimizer: str, p: int, g: int, k: int) -> None:
    model = byte_model(precision, optimizer)
    assert (model.param_bytes, model.grad_bytes, model.optimizer_bytes) == (p, g, k)
    assert model.describe().endswith(f"= {p + g + k} bytes per parameter")


def test_byte_model_is_printed_with_the_plan() -> None:
    text = str(plan("1B", gpus_per_node=1, gpu_memory="80GB"))
    assert "2 (bf16 params) + 2 (bf16 grads) + 12 (optimizer: fp32 master 4 + 2 x 4 Adam" in text
    assert "zero1 4 Psi + 12 Psi/N, zero2 2 Psi + 14 Psi/N, zero3 16 Psi/N" in text
    fp32 = str(plan("1B", gpus_per_node=1, gpu_memory="80GB", precision="fp32"))
    assert "4 (fp32 params) + 4 (fp32 grads) + 8 (optimizer: 2 x 4 Adam moments) = 16" in fp32


def test_sgd_needs_less_than_adam() -> None:
    adam = plan("1B", gpus_per_node=2, gpu_memory="80GB").estimate("ddp").memory
    sgd = plan("1B", gpus_per_node=2, gpu_memory="80GB", optimizer="sgd").estimate("ddp").memory
    assert (adam.model_states, sgd.model_states) == (16 * GB, 8 * GB)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "fp8"}, r"unknown precision='fp8'; choose one of: bf16-mixed, fp16"),
        ({"optimizer": "lion"}, r"unknown optimizer='lion'; choose one of: adam, adamw, sgd"),
        ({"gpus_per_node": 0}, r"gpus_per_node=0 must be a positive int"),
        ({"gpus_per_node": "4"}, r"gpus_per_node='4' must be a positive int"),
        ({"nodes": True}, r"nodes=True must be a positive int"),
        ({"gpu_memory": 80}, r"gpu_memory=80 is 80 bytes.*'80GB'"),
        ({"gpu_memory": "80 gigs"}, r"gpu_memory='80 gigs' is not a memory size"),
        ({"cpu_memory": -1}, r"cpu_memory=-1 must be a positive memory size"),
        ({"headroom": 1.0}, r"headroom=1.0 must be a fraction"),
        ({"activation": {"seq_len": 2048}}, r"activation=.* must be an Activations"),
    ],
)
def test_bad_inputs_name_the_value_and_the_fix(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"gpus_per_node": 4, "gpu_memory": "80GB", **kwargs}
    with pytest.raises(ConfigError, match=message):
        plan("13B", **args)  # type: ignore[arg-type]


def test_estimate_lists_the_strategies() -> None:
    p = plan("13B", gpus_per_node=4, gpu_memory="80GB")
    assert [e.strategy for e in p.estimates] == list(STRATEGIES)
    with pytest.raises(ConfigError, match="unknown strategy 'fsdp'; choose one of: ddp, zero1"):
        p.estimate("fsdp")


# --- sizes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("13B", 13 * 10**9),
        ("7.5B", 7_500_000_000),
        ("1.3b", 1_300_000_000),
        ("350M", 350_000_000),
        (" 70 B ", 70 * 10**9),
        ("1T", 10**12),
        (13_000_000_000, 13 * 10**9),
        (1.5e9, 1_500_000_000),
    ],
)
def test_parse_count(text: object, count: int) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize("bad", ["13X", "", "B", "-1B", 0, -5, True, None, [13]])
def test_parse_count_refuses(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"params=.*(parameter count|such as '13B')"):
        parse_count(bad)


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("80GB", 80 * GB),
        ("80 GB", 80 * GB),
        ("80GiB", 80 * 2**30),
        ("1.5TB", 1_500 * GB),
        ("512gb", 512 * GB),
        (24 * GB, 24 * GB),
        ("85899345920", 85_899_345_920),
    ],
)
def test_parse_bytes(text: object, nbytes: int) -> None:
    assert parse_bytes(text, name="gpu_memory") == nbytes


def test_format_bytes() -> None:
    assert [format_bytes(x) for x in (52 * GB, 1.12e12, 234_375_000, 71.5 * GB, 5)] == [
        "52.0 GB",
        "1.12 TB",
        "234 MB",
        "71.5 GB",
        "5 B",
    ]


# --- counting a model --------------------------------------------------------------------


def test_module_on_the_meta_device_is_counted_without_memory() -> None:
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(1000, 2000), torch.nn.Linear(2000, 10))
    size = model_size(model)
    assert size.params == 1000 * 2000 + 2000 + 2000 * 10 + 10
    assert size.largest_layer_params == 1000 * 2000 + 2000
    assert "Sequential (nn.Module" in size.source


def test_factory_is_built_on_the_meta_device() -> None:
    torch = pytest.importorskip("torch")
    devices = []

    def build() -> object:
        model = torch.nn.Linear(4096, 4096)
        devices.append(model.weight.device.type)
        return model

    assert plan(build, gpus_per_node=1, gpu_memory="24GB").model.params == 4096 * 4096 + 4096
    assert devices == ["meta"]


def test_factory_must_return_a_module() -> None:
    pytest.importorskip("torch")
    with pytest.raises(ConfigError, match=r"returned int, not an nn\.Module"):
        model_size(lambda: 3)


def test_shared_parameters_count_once_and_frozen_ones_have_no_optimizer_state() -> None:
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        embed = torch.nn.Embedding(1000, 64)
        head = torch.nn.Linear(64, 1000, bias=False)
        head.weight = embed.weight  # tied
        adapter = torch.nn.Linear(64, 64)
        model = torch.nn.Sequential(embed, adapter, head)
    embed.weight.requires_grad_(False)
    size = model_size(model)
    assert (size.params, size.trainable_params) == (64_000 + 4160, 4160)
    memory = plan(model, gpus_per_node=1, gpu_memory="1GB").estimate("ddp").memory
    assert (memory.params, memory.grads, memory.optimizer) == (2 * 68160, 2 * 4160, 12 * 4160)


def test_zero3_counts_the_gathered_module_when_modules_are_known() -> None:
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8)))
    p = plan(model, gpus_per_node=8, gpu_memory="1GB")
    assert p.estimate("zero3").memory.working == 4 * (1024 * 1024 + 1024)
    assert p.estimate("zero2").memory.working == 0
    assert any("ZeRO-3 gathers one module at a time" in a for a in p.assumptions)


def test_module_with_hf_config_gives_its_shape() -> None:
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        model = torch.nn.Linear(8, 8)
    model.config = SimpleNamespace(**llama2("7B"))  # type: ignore[assignment]
    size = model_size(model)
    assert (size.params, size.hidden_size, size.num_layers) == (72, 4096, 32)
    model.config = SimpleNamespace(hidden_size=4096)  # type: ignore[assignment]
    assert model_size(model).hidden_size is None  # an incomplete config does not stop the count


@pytest.mark.parametrize("name", sorted(LLAMA2))
def test_hf_config_formula_matches_llama2(name: str) -> None:
    published = LLAMA2[name][1]
    assert model_size(llama2(name)).params == published  # config.json as a dict
    assert model_size(SimpleNamespace(**llama2(name))).params == published  # a config object


def test_hf_config_gpt2_within_one_percent() -> None:
    gpt2 = SimpleNamespace(
        model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
        activation_function="gelu_new", n_inner=None,
    )  # fmt: skip
    size = model_size(gpt2)
    assert abs(size.params - 124_439_808) / 124_439_808 < 0.01
    assert "plain MLP, tied embeddings" in size.source


def test_hf_config_gives_the_shape_for_activations() -> None:
    p = plan(
        llama2("13B"),
        gpus_per_node=4,
        gpu_memory="80GB",
        activation=Activations(seq_len=2048, batch_size=1),
    )
    assert p.activations is not None
    assert p.activations.bytes == 34 * 2048 * 5120 * 40 + 4 * 2048 * 32000
    assert p.estimate("ddp").memory.activations == p.activations.bytes


def test_hf_config_refuses_moe_and_missing_fields() -> None:
    with pytest.raises(ConfigError, match=r"mixture of experts .*8 experts.*meta"):
        model_size({**llama2("7B"), "num_local_experts": 8})
    with pytest.raises(ConfigError, match=r"layer count \(num_hidden_layers or n_layer"):
        model_size({"hidden_size": 4096, "vocab_size": 32000})


def test_unknown_model_type() -> None:
    with pytest.raises(ConfigError, match=r"model_or_param_count=\[1\] \(list\) is not a model"):
        model_size([1])


# --- activations -------------------------------------------------------------------------


def test_activation_formulas() -> None:
    def acts(**kwargs: object) -> int:
        spec = Activations(seq_len=1024, batch_size=2, hidden_size=512, num_layers=4, **kwargs)  # type: ignore[arg-type]
        p = plan("100M", gpus_per_node=1, gpu_memory="24GB", activation=spec)
        assert p.activations is not None
        return p.activations.bytes

    sbh = 1024 * 2 * 512
    assert acts() == 4 * 34 * sbh
    assert acts(attention_scores=True, num_heads=8) == 4 * (34 * sbh + 5 * 8 * 1024 * 1024 * 2)
    assert acts(checkpointing=True) == 4 * 2 * sbh + 34 * sbh
    assert acts(vocab_size=1000) == 4 * 34 * sbh + 4 * 1024 * 2 * 1000


def test_activations_double_in_fp32() -> None:
    spec = Activations(seq_len=128, batch_size=1, hidden_size=64, num_layers=2)
    half = plan("1M", gpus_per_node=1, gpu_memory="1GB", activation=spec).activations
    full = plan("1M", gpus_per_node=1, gpu_memory="1GB", activation=spec, precision="fp32")
    assert half is not None and full.activations is not None
    assert full.activations.bytes == 2 * half.bytes


def test_activations_need_the_shape() -> None:
    with pytest.raises(ConfigError, match=r"hidden size and layer count.*--hidden-size"):
        plan(
            "13B",
            gpus_per_node=4,
            gpu_memory="80GB",
            activation=Activations(seq_len=1, batch_size=1),
        )
    with pytest.raises(ConfigError, match=r"attention_scores=True\) needs the head count"):
        spec = Activations(
            seq_len=8, batch_size=1, hidden_size=8, num_layers=1, attention_scores=True
        )
        plan("1M", gpus_per_node=1, gpu_memory="1GB", activation=spec)
    with pytest.raises(ConfigError, match=r"Activations\(seq_len=0\) must be a positive int"):
        Activations(seq_len=0, batch_size=1)  # fmt: skip


def test_activations_can_tip_the_recommendation() -> None:
    spec = Activations(seq_len=2048, batch_size=1, hidden_size=5120, num_layers=40)
    p = plan("13B", gpus_per_node=4, gpu_memory="80GB", activation=spec)
    assert p.estimate("zero3").memory.gpu_total == 52 * GB + 34 * 2048 * 5120 * 40
    assert p.recommended == "zero2_offload"  # zero3 at 83 % leaves no headroom


# --- the recommendation ------------------------------------------------------------------


def test_small_model_gets_plain_ddp() -> None:
    p = plan("1B", gpus_per_node=8, gpu_memory="80GB")
    assert p.recommended == "ddp"
    assert "and it communicates least" in p.reasons[0]
    assert p.reasons[-1] == "Run it as: DistributedDataParallel."


def test_nothing_fits_says_what_to_change() -> None:
    p = plan("1T", gpus_per_node=1, gpu_memory="24GB", cpu_memory="256GB")
    assert p.recommended is None
    assert p.reasons[-1].startswith("Nothing fits.") and "Add GPUs" in p.reasons[-1]
    assert "Recommended: nothing fits" in str(p)


def test_headroom_is_a_knob() -> None:
    assert plan("13B", gpus_per_node=4, gpu_memory="80GB", headroom=0.05).recommended == "zero2"


def test_plan_is_a_frozen_value() -> None:
    p = plan("13B", gpus_per_node=4, gpu_memory="80GB")
    with pytest.raises(AttributeError):
        p.recommended = "ddp"  # type: ignore[misc]
    assert p == plan("13B", gpus_per_node=4, gpu_memory="80GB")


def test_table_and_json() -> None:
    p = plan("13B", gpus_per_node=4, gpu_memory="80GB")
    text = str(p)
    assert "1 node x 4 GPUs of 80.0 GB (N = 4)" in text
    row = next(line for line in text.splitlines() if line.startswith("zero3 "))
    assert row.split() == ["zero3", "6.50", "GB", "6.50", "GB", "39.0", "GB", "-", "52.0", "GB",
                           "65%", "-", "yes"]  # fmt: skip
    assert "Recommended: zero3 - ZeRO-3 / FSDP" in text
    data = json.loads(json.dumps(p.to_dict()))
    assert data["recommended"] == "zero3"
    assert data["bytes_per_param"] == {"params": 2, "grads": 2, "optimizer": 12, "total": 16}
    assert data["strategies"][0]["gpu_total_bytes"] == 208 * GB
    assert data["strategies"][3]["formula"] == "16 Psi/N"


# --- cluster advice ----------------------------------------------------------------------


def test_advice_13b_single_node_of_a100_80gb() -> None:
    advice = advise_cluster("13B")
    assert advice.recommended is not None
    r = advice.recommended
    assert (r.gpu.name, r.nodes, r.gpus_per_node, r.strategy) == ("A100 80GB", 1, 4, "zero3")
    layouts = {o.gpu.name: (o.nodes, o.gpus_per_node) for o in advice.options}
    assert layouts == {"A10G": (2, 8), "A100 40GB": (1, 8), "A100 80GB": (1, 4), "H100": (1, 4)}
    assert advice.summary.startswith("single node")
    assert any("H100 has the same 80 GB" in reason for reason in advice.reasons)


def test_advice_70b_goes_multi_node_or_offloads() -> None:
    advice = advise_cluster("70B")
    assert advice.recommended is not None
    assert (advice.recommended.nodes, advice.recommended.gpu.name) == (3, "A100 80GB")
    assert advice.summary.startswith("multi-node")
    assert any("InfiniBand" in reason for reason in advice.reasons)
    assert any("zero3_offload" in r and "1.12 TB of CPU memory" in r for r in advice.reasons)


def test_advice_small_model_one_gpu() -> None:
    advice = advise_cluster("1B")
    assert advice.recommended is not None
    assert (advice.recommended.gpu.name, advice.recommended.gpus_per_node) == ("A10G", 1)
    assert "fits on one GPU" in advice.reasons[0]
    with pytest.raises(ConfigError, match="max_nodes=0 must be a positive int"):
        advise_cluster("1B", max_nodes=0)


# --- command line ------------------------------------------------------------------------


def test_cli_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--params", "13B", "--gpus-per-node", "4", "--gpu-memory", "80GB"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Recommended: zero3" in out and "208 GB" in out and "Assumptions:" in out


def test_cli_plan_json_with_cluster_advice(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--params", "70B", "--gpus-per-node", "8", "--gpu-memory", "80GB",
                 "--cpu-memory", "2TB", "--json", "--advise-cluster"])  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["recommended"] == "zero3_offload"
    assert data["cluster"]["cpu_memory_bytes"] == 2 * 10**12
    assert data["cluster_advice"]["recommended"]["nodes"] == 3


def test_cli_activations_and_hf_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(llama2("7B")))
    cluster = ["--gpus-per-node", "1", "--gpu-memory", "80GB"]
    run = ["--seq-len", "4096", "--batch-size", "1", "--checkpointing", "--json"]
    code = main(["plan", "--hf-config", str(config), *cluster, *run])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["model"]["params"] == 6_738_415_616
    assert data["activation_bytes"] == 2 * 4096 * 4096 * 32 + 34 * 4096 * 4096 + 4 * 4096 * 32000


def test_cli_advice_alone(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "13B", "--advise-cluster"]) == 0
    out = capsys.readouterr().out
    assert "Advice: single node: 1 node x 4 A100 80GB with zero3" in out
    assert "Memory plan" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "13X", "--gpus-per-node", "4", "--gpu-memory", "80GB"], "--params='13X'"),
        (["--params", "13B", "--gpus-per-node", "4", "--gpu-memory", "80"], "write the unit"),
        (["--params", "13B", "--gpus-per-node", "0", "--gpu-memory", "80GB"], "gpus_per_node=0"),
        (["--params", "13B"], "pass --gpus-per-node N and --gpu-memory SIZE"),
        (["--params", "13B", "--gpus-per-node", "4"], "a plan needs both"),
        (["--params", "13B", "--advise-cluster", "--seq-len", "9"], "activations need both"),
        (["--hf-config", "/nonexistent/config.json", "--advise-cluster"], "could not be read"),
    ],
)
def test_cli_bad_values_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sparktrain: error: ") and message in err


def test_cli_bad_choice_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--params", "13B", "--advise-cluster", "--precision", "fp8"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_cli_plan_options_are_frozen() -> None:
    import argparse

    from sparktrain.cli import _parser

    commands = next(
        a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    options = {o for a in commands["plan"]._actions for o in a.option_strings}
    assert options == {
        "-h", "--help", "--params", "--hf-config", "--gpus-per-node", "--nodes", "--gpu-memory",
        "--cpu-memory", "--precision", "--optimizer", "--headroom", "--seq-len", "--batch-size",
        "--hidden-size", "--layers", "--heads", "--vocab-size", "--checkpointing",
        "--attention-scores", "--json", "--advise-cluster", "--microbatches", "--tied-embeddings",
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "sparktrain", "plan", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--gpu-memory SIZE" in done.stdout


def test_planner_imports_nothing_heavy() -> None:
    code = (
        "import sys, sparktrain.planner as p, sparktrain.cli;"
        "p.plan('13B', gpus_per_node=4, gpu_memory='80GB'); p.advise_cluster('70B');"
        "print([m for m in ('torch', 'transformers', 'numpy') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
