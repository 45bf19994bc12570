"""The Ray backend: one actor per node, in a placement group; the Ray it starts ends with it."""
