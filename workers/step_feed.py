"""A rank's data for its steps: its share of each step, planned from the segment's spec with
the driver's own pure code (``elastic.core.data_plan``), and its samples, read on the loader
thread while the step before computes."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from typing import NamedTuple

from elastic.core.compute_replay import replay_due, replayed_group
from elastic.core.data_plan import DataCursor, RankShare, rank_share
from elastic.core.protocol import SegmentSpec
from workers.context_parallel import ContextShare
from workers.pipeline import pipeline_micro_batches
from workers.rank_spec import RankSpec
from workers.train_step import Batch

CPU = torch.device("cpu")


class StepBatches(NamedTuple):
    """A step's samples on the host: the rank's own, and the ones it replays (a spot check's)."""

    own: list[Batch]
    replayed: list[Batch] | None = None


class StepFeed:
    def __init__(self, rank: RankSpec, hooks, loader: ThreadPoolExecutor):
        self.rank, self.hooks, self.loader = rank, hooks, loader

    def share(self, spec: SegmentSpec, step: int, cursor: DataCursor) -> RankShare:
        rank = self.rank
        share = rank_share(spec, step, cursor, rank.group, rank.shard_index, rank.layout.shard)
        replayed = None
        if replay_due(step, spec.replay_every):
            replayed = pipeline_micro_batches(
                rank_share(spec, step, cursor, replayed_group(rank.group, spec.groups), rank.shard_index,
                           rank.layout.shard).micro_batches, rank.pipeline)
        return replace(share, micro_batches=pipeline_micro_batches(share.micro_batches, rank.pipeline),
                       replayed=replayed)

    def prefetch(self, share: RankShare) -> Future:
        """Read the step's samples on the loader thread while the current step computes: its
        own, and at a spot check the next group's it replays (``StepBatches``)."""
        def read(micro_batches) -> list[Batch]:
            return [self._own_part(self.hooks.micro_batch(mb, CPU, epoch=share.epoch)) for mb in micro_batches]

        return self.loader.submit(lambda: StepBatches(read(share.micro_batches),
                                                      read(share.replayed) if share.replayed is not None else None))

    def held_out(self, micro_batches, device: torch.device) -> list[Batch]:
        """An evaluation's samples, read now."""
        return [self._own_part(self.hooks.micro_batch(mb, device, held_out=True))
                for mb in pipeline_micro_batches(micro_batches, self.rank.pipeline)]

    def _own_part(self, batch: Batch) -> Batch:
        """What this rank computes of ``batch``: under context parallelism, its chunks of the
        sequences (the cp ranks of a shard position read the same rows)."""
        layout = self.rank.layout
        if layout.cp == 1:
            return batch
        return batch.context_share(ContextShare(layout.cp, self.rank.cp_index, batch.targets.shape[1]))
