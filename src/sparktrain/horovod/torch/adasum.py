"""Adasum (``op=hvd.Adasum``) on ``torch.distributed``: adaptive summation of the ranks' tensors.

Adasum combines two tensors ``a`` and ``b`` as
``(1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b``: their sum when they are orthogonal, their
average when they are parallel, and in between otherwise (Maleki et al., "Scaling Distributed
Training with Adaptive Summation", MLSys 2021). Over N ranks the tensors are combined pairwise
in a binary tree of rank order, ``(0, 1), (2, 3), ...`` then the pairs' results, as Horovod's
recursive doubling does for a power of two; here N need not be a power of two (the last tensor
of an odd level moves up unchanged). Horovod refuses that on CPUs; this does not.

Every rank gathers every tensor (``all_gather``) and computes the same tree, so every rank ends
with the same result; memory is N copies of the tensor for the moment of the call, which suits
gradient-sized tensors on the small groups Adasum is used with. Dot products and norms are
taken in float64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: Squared norms below this count as zero: that tensor's coefficient is 1.
EPSILON = 1e-30


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two tensors of the same shape."""
    dot = torch.sum(a.double() * b.double())
    norm_a, norm_b = torch.sum(a.double() ** 2), torch.sum(b.double() ** 2)
    coeff_a = 1 - dot / (2 * norm_a) if norm_a > EPSILON else torch.ones((), dtype=torch.float64)
    coeff_b = 1 - dot / (2 * norm_b) if norm_b > EPSILON else torch.ones((), dtype=torch.float64)
    return (coeff_a.to(a.dtype) * a) + (coeff_b.to(b.dtype) * b)


def tree(parts: list[torch.Tensor]) -> torch.Tensor:
    """Adasum of ``parts`` combined pairwise in a binary tree of their order."""
    level = list(parts)
    while len(level) > 1:
        pairs = [combine(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = pairs + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def allreduce(tensor: torch.Tensor) -> torch.Tensor:
    """The Adasum of every rank's ``tensor``, the same on every rank (a collective)."""
    mine = tensor.detach().contiguous()
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return tree(parts)
