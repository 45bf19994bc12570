"""The node side of the Ray backend: inside the actor of one node."""
