"""Which checkpoint-engine workers share a node, and the groups that carry buckets between nodes.

On CPU the workers of one node share one pair of IPC buffers in POSIX shared memory: the owner of
a bucket writes it once and every worker's inference engine maps the same bytes, so nothing is
copied to deliver a bucket inside a node. Between nodes a bucket travels over torch.distributed
(gloo, or NCCL on GPU) from its owner to one worker of every other node, the owner's "rail": the
worker with the owner's local index there, so the nodes' links carry the traffic in parallel.

Whether two workers really share ``/dev/shm`` is checked, not assumed: the first worker of a node
writes a random token into the buffer and the others must read it back; a worker that cannot is
treated as a node of its own (buckets then reach it over torch.distributed).
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from checkpoint_engine.shm import SharedBuffer


@dataclass
class Topology:
    """``nodes[n]``: the ranks of node n, ascending; ``node_of[r]``: the node of rank r."""

    rank: int
    nodes: list[list[int]]
    node_of: list[int]

    @classmethod
    def from_keys(cls, rank: int, keys: list[str]) -> Topology:
        order = sorted(set(keys), key=keys.index)  # nodes in order of their first rank
        nodes = [[r for r, k in enumerate(keys) if k == key] for key in order]
        return cls(rank, nodes, [order.index(k) for k in keys])

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    @property
    def leader(self) -> int:
        """The rank that creates (and removes) this node's shared buffers."""
        return self.nodes[self.node][0]

    def shares_buffers(self, other: int) -> bool:
        return self.node_of[other] == self.node

    def rail(self, owner: int) -> list[int]:
        """The ranks that take ``owner``'s buckets off the network: the owner and, on every other node,
        the worker with the owner's local index (modulo that node's size)."""
        local = self.nodes[self.node_of[owner]].index(owner)
        return sorted(owner if n == self.node_of[owner] else ranks[local % len(ranks)]
                      for n, ranks in enumerate(self.nodes))


class NodeBuffers:
    """This node's two shared IPC buffers and the process groups the update pipeline needs."""

    def __init__(self, rank: int, world: int, name: str, nbytes: int, node: str | None = None) -> None:
        key = node if node is not None else socket.gethostname()
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (key, random.getrandbits(62) + 1))
        keys, tokens = [k for k, _ in gathered], [t for _, t in gathered]
        topo = Topology.from_keys(rank, keys)
        if rank == topo.leader:
            self.buffers = self._create(name, rank, nbytes)
            self.buffers[0].tensor[:8].view(torch.int64)[0] = tokens[rank]
        dist.barrier()
        ok = rank == topo.leader or self._attach(name, topo.leader, nbytes, tokens[topo.leader])
        oks: list = [None] * world
        dist.all_gather_object(oks, ok)
        if not all(oks):  # some workers do not see their node's /dev/shm: each of those is its own node
            topo = Topology.from_keys(rank, [k if oks[r] else f"{k}#{r}" for r, k in enumerate(keys)])
            if not ok:
                self.buffers = self._create(name, rank, nbytes)
        self.topology = topo
        self.names = [b.name for b in self.buffers]
        # one group per node (for its barrier) and one per distinct rail; every rank creates every group
        self._node_groups = [self._group(ranks, world) for ranks in topo.nodes]
        rails = sorted({tuple(topo.rail(o)) for o in range(world)}) if len(topo.nodes) > 1 else []
        self._rail_groups = {r: self._group(list(r), world) for r in rails}

    @staticmethod
    def _create(name: str, leader: int, nbytes: int) -> list[SharedBuffer]:
        return [SharedBuffer.create(f"{name}-l{leader}-ipc{i}", nbytes) for i in range(2)]

    def _attach(self, name: str, leader: int, nbytes: int, token: int) -> bool:
        """Map the leader's buffers; False if this worker does not see them (another /dev/shm)."""
        try:
            self.buffers = [SharedBuffer.attach(f"{name}-l{leader}-ipc{i}", nbytes) for i in range(2)]
        except (FileNotFoundError, ValueError):
            return False
        return int(self.buffers[0].tensor[:8].view(torch.int64)[0]) == token

    @staticmethod
    def _group(ranks: list[int], world: int):
        return None if len(ranks) == world else dist.new_group(ranks)

    def barrier(self) -> None:
        """Every worker of this node has reached this point (its replica is done with what came before)."""
        if len(self.topology.nodes[self.topology.node]) > 1:
            dist.barrier(group=self._node_groups[self.topology.node])

    def rail_group(self, owner: int):
        """The group that carries ``owner``'s buckets between nodes (None: the default group)."""
        return self._rail_groups[tuple(self.topology.rail(owner))]

    @property
    def multi_node(self) -> bool:
        return len(self.topology.nodes) > 1

    def close(self) -> None:
        for b in self.buffers:
            b.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host`` (loopback: a torch.distributed rendezvous, a local service)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
