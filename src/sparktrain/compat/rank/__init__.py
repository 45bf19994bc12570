"""What the front doors of ``compat/`` run inside the ranks.

TensorFlow's worker, DeepSpeed's configuration, and ``BarrierTaskContext`` answered in a rank.
"""
