"""``sparktrain.elastic``: what a rank of an elastic run needs to keep its training the same.

The public name of :mod:`sparktrain.rank.elastic` (where the code lives, with the rest of what
runs inside a rank): ``from sparktrain import elastic`` and ``import sparktrain.elastic`` both
give these functions.
"""

from sparktrain.rank.elastic import accumulation, in_place, mesh, target_world_size, world_size

__all__ = ["accumulation", "in_place", "mesh", "target_world_size", "world_size"]
