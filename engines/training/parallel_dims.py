"""The trainers' parallel layout, owned in one place: how many ranks, how they shard the model, which rank does what.

A run has ``workers`` colocated workers; each holds ``ranks_per_worker`` trainer ranks (one per GPU of a
tensor-parallel replica, else one). Every rank of every worker is one rank of the default process group, and FSDP2
shards the model over all of them (``dp_shard``). With expert parallel (``ep`` > 1) the same ranks also form a (ep ×
world/ep) grid: along ``ep`` each group splits every MoE layer's experts, and the world/ep groups' ranks that hold
the same experts shard them between them (``engines.training.expert_parallel``), while FSDP2 still shards everything
else over all the ranks. Tensor parallel (``tp``) training is declared here, at 1, so the mesh, the settings and the
cluster already ask this object rather than reason about world sizes themselves. The first rank of a worker (its
lead) sends the worker's replica its updates and maps its IPC buffers; the worker's other ranks take part in every
collective.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """``workers`` workers of ``ranks_per_worker`` trainer ranks; the ranks shard the model ``dp_shard`` ways (0: all
    of them); ``ep`` ranks share each MoE layer's experts (it divides the world); ``tp`` is 1 for now."""

    workers: int
    ranks_per_worker: int = 1
    dp_shard: int = 0
    ep: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        if self.workers < 1 or self.ranks_per_worker < 1:
            raise ValueError(f"parallel dims: workers and ranks_per_worker must be at least 1, got {self.workers} and "
                             f"{self.ranks_per_worker}")
        if self.tp != 1:
            raise ValueError(f"parallel dims: tensor parallel training is not supported yet (tp={self.tp})")
        if self.ep < 1 or self.world % self.ep:
            raise ValueError(f"parallel dims: expert parallel size ep={self.ep} does not divide the {self.world} "
                             f"trainer ranks")
        if self.dp_shard not in (0, self.world):
            raise ValueError(f"parallel dims: dp_shard={self.dp_shard} must equal the {self.world} trainer ranks")

    @property
    def world(self) -> int:
        """Trainer ranks in all: one process group."""
        return self.workers * self.ranks_per_worker

    @property
    def shard_degree(self) -> int:
        """Ways the model's parameters are sharded (FSDP2)."""
        return self.dp_shard or self.world

    @property
    def sharded(self) -> bool:
        """Whether more than one rank shares the model."""
        return self.world > 1

    def lead(self, worker: int) -> int:
        """The rank that sends worker ``worker``'s replica its updates (the worker's first)."""
        self._check_worker(worker)
        return worker * self.ranks_per_worker

    def worker_of(self, rank: int) -> int:
        """The worker whose devices rank ``rank`` computes on."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not one of the {self.world} trainer ranks")
        return rank // self.ranks_per_worker

    def local_index(self, rank: int) -> int:
        """Rank ``rank``'s place in its worker: the GPU of the worker's replica it computes on."""
        return rank - self.lead(self.worker_of(rank))

    def is_lead(self, rank: int) -> bool:
        return self.local_index(rank) == 0

    def ranks_of(self, worker: int) -> range:
        """The ranks of worker ``worker``, its lead first."""
        return range(self.lead(worker), self.lead(worker) + self.ranks_per_worker)

    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """FSDP2's device mesh's dimension names and sizes: ``dp_shard``, over every rank."""
        return ("dp_shard",), (self.shard_degree,)

    @property
    def expert_replicas(self) -> int:
        """Ranks that hold the same experts (world / ep)."""
        return self.world // self.ep

    def build_expert_mesh(self, device_type: str):
        """The (``ep`` × ``dp_mod_ep``) grid the experts are split along (collective); None without expert parallel.
        Consecutive ranks form an expert-parallel group (so on a multi-GPU worker its tokens stay on the node); the
        ``dp_mod_ep`` ranks with the same place in their groups shard those experts between them."""
        if self.ep == 1:
            return None
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        grid = torch.arange(self.world).view(self.expert_replicas, self.ep).t()
        return DeviceMesh(device_type, grid, mesh_dim_names=("ep", "dp_mod_ep"))

    def build_mesh(self, device_type: str):
        """The device mesh FSDP2 shards over (collective: every rank builds it)."""
        from torch.distributed.device_mesh import init_device_mesh

        names, shape = self.mesh_shape()
        return init_device_mesh(device_type, shape, mesh_dim_names=names)

    def _check_worker(self, worker: int) -> None:
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} is not one of the {self.workers} workers")
