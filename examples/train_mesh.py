"""A small Llama-shaped transformer trained on a tensor x pipeline x FSDP mesh of 4 processes.

Run it with ``python examples/train_mesh.py [--tp 2] [--pp 2]``. The model is an
``nn.Sequential`` (embedding, blocks, head), so ``pp`` can cut it into stages; its attention and
MLP name their projections ``wq/wk/wv/wo`` and ``w1/w2/w3``, so ``tp`` finds them with the
built-in plan. Every rank builds the same model from the same seed, runs the same loop, and the
whole trained state comes back from rank 0. The data are a fixed random token stream with a
learnable rule (each token is the previous one plus one), so the loss falls.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sparktrain


class Attention(nn.Module):
    """Causal self-attention with separate projections (what tensor parallelism splits)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.n_heads = heads  # divided by tp when the projections are split
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(width, width, bias=False) for _ in "qkvo")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w1``/``w3`` up (column-wise under tp), ``w2`` down (row-wise)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1, self.w3 = (nn.Linear(width, 2 * width, bias=False) for _ in range(2))
        self.w2 = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block (out-of-place adds: FSDP2's hooks need them)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width, bias=False), nn.LayerNorm(width, bias=False)
        self.attention, self.feed_forward = Attention(width, heads), FeedForward(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.feed_forward(self.norm2(x))


def build_model(
    width: int = 256, heads: int = 4, layers: int = 4, vocab: int = 512, seed: int = 0
) -> nn.Sequential:
    """Embedding, ``layers`` blocks, head: the same weights on every rank for one seed."""
    torch.manual_seed(seed)
    blocks = [Block(width, heads) for _ in range(layers)]
    return nn.Sequential(nn.Embedding(vocab, width), *blocks, nn.Linear(width, vocab, bias=False))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over every token."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def make_data(rows: int = 256, seq: int = 32, vocab: int = 512) -> TensorDataset:
    """Token rows where each token is the previous plus one (mod vocab)."""
    start = torch.randint(0, vocab, (rows, 1), generator=torch.Generator().manual_seed(1))
    tokens = (start + torch.arange(seq + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def train_fn(tp: int = 2, pp: int = 2, epochs: int = 2, batch_size: int = 8) -> dict:
    """Train on this rank's share of the mesh; the whole state dict (from every rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = sparktrain.prepare_model(
        build_model(), "fsdp", tp=tp, pp=pp, schedule="1f1b", microbatches=max(pp, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = sparktrain.prepare_data_loader(
        DataLoader(make_data(), batch_size=batch_size, shuffle=True, drop_last=True),
        drop_last=True,
    )
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = sparktrain.forward_backward(model, x, y, loss_fn)
            optimizer.step()
        print(f"epoch {epoch} loss {loss.item():.4f}")
    return sparktrain.full_state_dict(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--processes", type=int, default=4)
    args = parser.parse_args()
    state = sparktrain.launch(
        train_fn, (args.tp, args.pp), num_processes=args.processes, use_gpu=False
    ).value
    model = build_model()
    model.load_state_dict(state)  # whole tensors under the plain model's own names
    x, y = make_data()[:32]
    print(f"trained model, loss on 32 rows: {loss_fn(model(x), y).item():.4f}")


if __name__ == "__main__":
    main()
