"""The built-in loop of ``TorchEstimator.fit``, run by every rank (``epochs.train``).

- ``epochs``: the epochs, the validation rows, each epoch's record and what ends the fit;
- ``steps``: one epoch's batches, their losses, gradient accumulation, the train metrics;
- ``state``: a rank's fit in progress and the checkpoints a fit resumes from;
- ``controls``: early stopping and learning-rate schedules;
- ``metrics``: the metrics by name, computed over every rank's rows;
- ``lightning``: a ``LightningModule``'s hooks in this loop.

Nothing is imported here: the driver reads ``controls`` and ``metrics`` to check params.
"""
