"""Batch inference where the model runs: a rank of a launch, or one of Spark's Python workers."""
