"""Spark ML inside the ranks and the executors: a fit's training loop, a transform's scoring."""
