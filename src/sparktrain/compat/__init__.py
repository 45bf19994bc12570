"""Familiar front doors (pyspark's TorchDistributor, ...), each a thin adapter over ``launch``."""
