"""``LocalCluster``: several nodes on this machine, each a process of its own, lost at will."""
