"""What a rank actor is started with: its place in the layout and how to reach its peers."""

from __future__ import annotations

from dataclasses import dataclass

from checkpointing.pretrained import PretrainedSource
from checkpointing.storage import StorageOptions
from elastic.core.outer_rounds import OuterRounds
from elastic.core.topology import Position, Topology
from workers.pipeline import PipelineLayout


# The global rank and group of a warm spare, until it takes a lost rank's place (``assume``).
SPARE = -1


@dataclass(frozen=True)
class RankSpec:
    global_rank: int  # SPARE for a spare
    group: int
    group_rank: int  # its rank in the group's world (see elastic.core.topology)
    shard_index: int
    tp_index: int
    layout: Topology  # the run's layout (``elastic.core.topology``): its degrees, the numbering, the group's mesh
    seed: int
    use_gpu: bool
    store_host: str
    store_port: int
    store_secret: str  # hex: the run's key for its rendezvous keys and values (workers.keyed_store)
    collective_timeout_s: float
    storage: StorageOptions = StorageOptions()
    upload_in_process: bool = False
    replicate_dtype: str = "fp32"
    gpu_collectives: str = "nccl"  # or "gloo", where ranks share a GPU (scaling.gpu_collectives)
    pp_schedule: str = "1F1B"  # the pipeline's schedule, its stages per rank and the rows of a micro-batch:
    stages_per_rank: int = 1  # with the layout's pp, the ``pipeline``
    micro_batch: int = 1
    pp_index: int = 0  # its place along the group's pipeline
    pretrained: PretrainedSource | None = None  # the weights a build loads: a run's start from model.init_from
    cp_index: int = 0
    outer_rounds: OuterRounds | None = None  # DiLoCo's rounds (``sync.mode``); None: every step's gradients summed

    @property
    def pipeline(self) -> PipelineLayout:
        return PipelineLayout(self.layout.pp, self.pp_schedule, self.stages_per_rank, self.micro_batch)

    @property
    def ranks_per_group(self) -> int:
        return self.layout.ranks_per_group

    @property
    def nccl(self) -> bool:
        return self.use_gpu and self.gpu_collectives == "nccl"

    @property
    def position(self) -> Position:
        return Position(self.pp_index, self.shard_index, self.tp_index, self.cp_index)
