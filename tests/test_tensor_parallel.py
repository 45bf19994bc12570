"""prepare_model(..., tp=N): real gloo ranks against the same model trained in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparktrain import ConfigError, launch
from sparktrain.strategies.mesh import MeshShape, mesh_shape
from sparktrain.strategies.tensor_parallel import builtin_plan

VOCAB, DIM, HEADS, SEQ, BATCH, STEPS, LR = 32, 16, 4, 8, 4, 4, 0.5


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.head_dim = HEADS, DIM // HEADS
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM), nn.Linear(DIM, 2 * DIM)
        self.w2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attention = nn.LayerNorm(DIM), Attention()
        self.norm2, self.feed_forward = nn.LayerNorm(DIM), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.feed_forward(self.norm2(x))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over every token."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return loss_fn(model(x), y)


def share_of_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's data-parallel group's share of the batch (a tp group's ranks: the same)."""
    from sparktrain.strategies.mesh import data_share

    x, y = _batch()
    share = data_share()
    assert share is not None
    replicas, index = share
    return x.chunk(replicas)[index], y.chunk(replicas)[index]


def resume_from(model: Any, checkpoints: str | None) -> int:
    """Load the newest sharded checkpoint into ``model`` in place; its step."""
    import sparktrain

    assert checkpoints is not None
    state = model.state_dict()
    found = sparktrain.checkpoint.load_latest(checkpoints, into=state)
    assert found is not None
    model.load_state_dict(state)
    return found.step


def one_process(build: Any, steps: int = STEPS) -> list[float]:
    """The loss curve of ``build()`` trained in this process on the whole batch."""
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _batch()
    losses = []
    for _ in range(steps):
        loss = _loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _reference(steps: int = STEPS) -> list[float]:
    return one_process(Tiny, steps)


def run_steps(model: Any, checkpoints: str | None, resume: bool) -> list[float]:
    """Train the prepared ``model`` in a rank (saving at step 2, or resuming); the mean losses."""
    import torch.distributed as dist

    import sparktrain

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = share_of_batch()
    first = resume_from(model, checkpoints) if resume else 0
    losses = []
    for step in range(first, STEPS):
        if checkpoints and not resume and step == 2:
            sparktrain.checkpoint.save(model.state_dict(), checkpoints, step=step, sharded=True)
        opt.zero_grad()
        loss = sparktrain.forward_backward(model, x, y, loss_fn)
        opt.step()
        dist.all_reduce(loss)  # every replica's share: the whole batch's mean loss
        losses.append(loss.item() / dist.get_world_size())
    return losses


def _train(strategy: str, tp: int, checkpoints: str | None = None, resume: bool = False) -> Any:
    import torch.distributed as dist

    import sparktrain

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = sparktrain.prepare_model(Tiny(), strategy, tp=tp)
    losses = run_steps(model, checkpoints, resume)
    state = sparktrain.full_state_dict(model)
    local_heads = model.layers[0].attention.n_heads
    return losses, state, local_heads


@pytest.mark.slow
def test_tp2_matches_one_process_and_its_state_loads_into_a_plain_model() -> None:
    result = launch(_train, ("ddp", 2), num_processes=2, use_gpu=False)
    losses, state, local_heads = result.value
    assert losses == pytest.approx(_reference(), rel=1e-5, abs=1e-6)
    assert local_heads == HEADS // 2
    plain = Tiny()
    plain.load_state_dict(state)  # whole tensors, the model's own names
    x, y = _batch()
    torch.manual_seed(0)
    assert plain.layers[0].attention.wq.weight.shape == (DIM, DIM)
    trained = _loss(plain, x, y).item()
    assert trained == pytest.approx(_reference(STEPS + 1)[-1], rel=1e-4)


@pytest.mark.slow
def test_fsdp_x_tp_2x2_matches_one_process_and_resumes_bit_identically(tmp_path: Path) -> None:
    through = launch(_train, ("fsdp", 2, str(tmp_path)), num_processes=4, use_gpu=False)
    assert through.value[0] == pytest.approx(_reference(), rel=1e-5, abs=1e-6)
    resumed = launch(_train, ("fsdp", 2, str(tmp_path), True), num_processes=4, use_gpu=False)
    assert resumed.value[0] == through.value[0][2:]  # steps 2 and 3, bit for bit
    for name, tensor in through.value[1].items():
        assert torch.equal(tensor, resumed.value[1][name]), name


def test_mesh_errors_name_the_fix() -> None:
    assert mesh_shape(8, tp=2, pp=2, node_size=4) == MeshShape(pp=2, dp=2, tp=2)
    assert MeshShape(pp=2, dp=2, tp=2).coordinate(5) == (1, 0, 1)
    with pytest.raises(ConfigError, match=r"tp=3 x pp=1 = 3 does not divide the 4 ranks"):
        mesh_shape(4, tp=3, node_size=4)
    with pytest.raises(ConfigError, match=r"Use tp in \[1, 2\] with pp=2"):
        mesh_shape(4, tp=3, pp=2, node_size=4)
    with pytest.raises(ConfigError) as refused:  # no tp helps when pp does not divide
        mesh_shape(4, pp=3, node_size=4)
    assert "pp=3 does not divide 4, so no tp fits with it. Use pp in [1, 2, 4]" in str(
        refused.value
    )
    assert "tp in" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"tp=8 is larger than a node \(4 ranks a node\)"):
        mesh_shape(16, tp=8, node_size=4)
    with pytest.raises(ConfigError, match=r"tp=2 does not divide the 3 ranks of a node"):
        mesh_shape(6, tp=2, node_size=3)
    with pytest.raises(ConfigError, match=r"tp=0 must be a positive integer"):
        mesh_shape(4, tp=0, node_size=4)


def test_builtin_plan_and_what_it_refuses() -> None:
    plan, attention = builtin_plan(Tiny(), 2)
    assert plan["layers.0.attention.wq"] == "colwise" and plan["layers.1.attention.wo"] == "rowwise"
    assert plan["layers.0.feed_forward.w1"] == "colwise"
    assert plan["layers.0.feed_forward.w2"] == "rowwise" and plan["embed"] == "embedding"
    assert "head" not in plan and "norm" not in plan and attention[0] == "layers.0.attention"
    with pytest.raises(ConfigError, match=r"tp=3 does not divide layers.0.attention.wq"):
        builtin_plan(Tiny(), 3)
    encoder = nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=32, batch_first=True)
    assert builtin_plan(encoder, 2)[0] == {"linear1": "colwise", "linear2": "rowwise"}


def _no_plan(tp: int, plan: Any) -> None:
    import torch.distributed as dist

    import sparktrain

    dist.init_process_group("gloo")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    sparktrain.prepare_model(model, "fsdp", tp=tp, parallelize_plan=plan)


@pytest.mark.parametrize(
    ("tp", "plan", "message"),
    [
        (2, None, "the model has no layer the built-in plan splits"),
        (2, {"2.weight": None}, r"names '2.weight', which is no module"),
        (1, {"0": None}, "parallelize_plan was given with tp=1"),
        (3, None, "tp=3 x pp=1 = 3 does not divide the 2 ranks"),
    ],
)
def test_errors_in_the_ranks_name_the_fix(tp: int, plan: Any, message: str) -> None:
    with pytest.raises(Exception, match=message):
        launch(_no_plan, (tp, plan), num_processes=2, use_gpu=False)


SHAPE = {"layers": 2, "hidden": DIM, "vocab": VOCAB, "seq_len": 4096, "micro_batch": 8}


def _auto(gpu_memory: str) -> Any:
    import torch.distributed as dist

    import sparktrain

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = sparktrain.prepare_model(Tiny(), "auto", gpu_memory=gpu_memory, plan_shape=SHAPE)
    plain = getattr(model, "module", model)
    return plain.layers[0].attention.n_heads, type(model).__name__


def test_auto_follows_the_planners_mesh(capfd: pytest.CaptureFixture[str]) -> None:
    from sparktrain.planner import plan

    chosen = plan(Tiny(), gpus_per_node=2, gpu_memory="80MB", precision="fp32", **SHAPE)
    assert chosen.recommended_mesh is not None and chosen.recommended_mesh.tp == 2
    assert not chosen.mesh(1, 1).fits_with_headroom  # activations: FSDP alone does not fit
    split = launch(_auto, ("80MB",), num_processes=2, use_gpu=False).value
    assert split == (HEADS // 2, "FSDPTiny")  # tensor parallel, sharded over dp=1
    whole = launch(_auto, ("1GB",), num_processes=2, use_gpu=False).value
    assert whole == (HEADS, "DistributedDataParallel")  # room for everything: plain DDP
    out = capfd.readouterr().out
    assert "strategy='auto' chose tp=2 pp=1 dp=1 (runs as fsdp {'tp': 2, 'pp': 1})" in out
