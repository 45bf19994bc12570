"""Training on a Spark DataFrame: each rank's share of the rows as a torch dataset.

Inside a rank started by ``TorchDistributor.train_on_dataframe``::

    from sparktrain.data import rank_dataloader
    for features, label in rank_dataloader(batch_size=64):
        ...

Every rank holds the same number of rows (shorter shares repeat rows from their start, as
``DistributedSampler`` pads), so every rank runs the same number of batches and DDP's collectives
never wait for a rank that ran out of data.
"""

from sparktrain.data.shard import ShardDataset, rank_dataloader, rank_dataset

__all__ = ["ShardDataset", "rank_dataloader", "rank_dataset"]
