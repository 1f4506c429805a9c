"""Point-to-point weight updates into rollout replicas that run apart from the trainers (disaggregated placement).

Every trainer rank sends the buckets it owns straight to every replica, over one two-rank process group per
(trainer rank, replica) pair (``Link``: gloo on CPU, so a replica may sit on any node). Per bucket k of owner o:

  sender o   stages bucket k into its slot i mod 2 (i: k's place among o's buckets), casting or quantising on the
             way as the broadcast does, then hands it to every link: over the wire (``isend``), or, for a replica
             on its node, only a signal, the replica reading the slot where it lies (POSIX shared memory);
  replica    takes bucket k from o's link (into its own buffer k mod 2, the receive of k+1 already posted while it
             loads k), checks its trailer and loads it into its sink; over shared memory it acknowledges the load.

The sender reuses a slot once every link is done with the bucket before in it: its send completed, or its replica
acknowledged the load. Nothing waits for a reply per bucket across the wire, so the pipeline runs at the rate of
the slower of staging and loading.

The replica keeps generating meanwhile: where its sink loads into a spare copy (``WeightSink.stages``), the update
ends staged and the driver swaps it in with ``WeightReceiver.commit_staged`` between two generation rounds, the
only pause. A bucket that fails verification (aborted by its owner, damaged, of another update) rolls the replica's
update back; a sender that fails to stage a bucket still sends it, marked aborted, so no replica waits for it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch

from checkpoint_engine.buckets import BucketPlan
from checkpoint_engine.engine import UpdateError, stage_bucket
from checkpoint_engine.quantize import OwnerQuantizer
from checkpoint_engine.shm import SharedBuffer
from checkpoint_engine.trailer import ABORT, TRAILER, write_trailer
from checkpoint_engine.wire import PairLink, rendezvous_store
from engines.device import map_ipc

DATA, SIGNAL, ACK = 0, 1, 2  # message tags of a link


@dataclass(frozen=True)
class Endpoint:
    """Where a replica finds a trainer rank's link: its store's address, the node it runs on, and its slots
    (``("shm", name, nbytes)`` handles a replica on the same node maps)."""

    host: str
    port: int
    node: str
    slots: tuple


def node_name() -> str:
    """This process's node, as links compare them (a shared ``/dev/shm`` needs the same host)."""
    return socket.gethostname()


class Link(PairLink):
    """One replica's link to one trainer rank (trainer rank 0, replica 1). ``shared``: the replica maps the sender's
    slots (same node), so the link carries signals and acknowledgements only."""

    def __init__(self, store, key: str, rank: int, shared: bool, timeout_s: float) -> None:
        """``key`` names this link in the sender's store, different for a replica that replaces another."""
        super().__init__(store, key, rank, timeout_s)
        self.shared = shared


class P2PSender:
    """A trainer rank's end of the point-to-point updates: two host slots, one link per replica. Implements the
    update half of ``checkpoint_engine.engine.WeightTransport`` (``update``); staging is the broadcast engine's
    (``stage_bucket``: casts and FP8 quantisation included). Host memory only: GPU senders are not built."""

    def __init__(self, rank: int, bucket_bytes: int, name: str, timeout_s: float = 120,
                 host: str = "127.0.0.1", shm: bool = True) -> None:
        """``name``: this rank's slots' shared-memory prefix; ``host``: the address replicas reach this rank's store
        at; ``shm``: offer shared-memory slots to replicas on this node (False: every bucket crosses the wire, as
        between nodes)."""
        self.rank, self.timeout_s = rank, timeout_s
        size = bucket_bytes + TRAILER
        self.slots = [SharedBuffer.create(f"{name}-p2p{i}", size) for i in range(2)]
        self.store = rendezvous_store(host, 0, True, timeout_s)
        self.endpoint = Endpoint(host, self.store.port, node_name() if shm else f"{node_name()}-wire",
                                 tuple(("shm", b.name, b.nbytes) for b in self.slots))
        self.links: dict[int, Link] = {}
        self.targets: list[int] | None = None  # the replicas the next update goes to (None: every linked one)

    def connect(self, replica: int, shared: bool, key: str | None = None) -> None:
        """Open the link to replica ``replica`` (which calls ``P2PReceiver.connect`` with the same ``key`` at the same
        time; default: the replica's index)."""
        self.links[replica] = Link(self.store, key or str(replica), 0, shared, self.timeout_s)

    def update(self, plan: BucketPlan, tensors, version: int, reloader=None, offsets=None, tap=None) -> None:
        """Send this rank's buckets of update ``version`` to every linked replica (``tensors``: this rank's own, as
        for ``CheckpointEngine.update``; every trainer rank calls this, for FP8 quantisation is collective)."""
        quant = OwnerQuantizer(plan, tensors, offsets or {}, torch.device("cpu")) if plan.fp8 else None
        if quant is not None:
            quant.prepare()
        mine = [k for k, o in enumerate(plan.owners) if o == self.rank]
        busy: list[list] = [[], []]  # per slot: what must finish before it is written again
        failure: Exception | None = None
        try:
            for i, k in enumerate(mine):
                slot, used = i % 2, plan.used_bytes(k)
                for wait in busy[slot]:
                    wait()
                dst = self.slots[slot].tensor[: used + TRAILER]
                try:
                    stage_bucket(plan, plan.buckets[k], tensors, offsets or {}, quant, dst, used, version, k,
                                 self.rank)
                except Exception as e:  # sent all the same, marked: its replicas roll back instead of waiting
                    failure = failure or e
                    write_trailer(dst, used, version, ABORT)
                busy[slot] = [self._hand(link, dst, version, k, slot) for r, link in self.links.items()
                              if self.targets is None or r in self.targets]
            for waits in busy:
                for wait in waits:
                    wait()
        except Exception as e:
            raise UpdateError(f"trainer rank {self.rank}: point-to-point update {version} failed: {e}") from e
        if failure is not None:
            raise UpdateError(f"trainer rank {self.rank} failed to stage a bucket of update {version}: "
                              f"{type(failure).__name__}: {failure}") from failure

    @staticmethod
    def _hand(link: Link, dst: torch.Tensor, version: int, k: int, slot: int):
        """Give bucket k to one replica; returns what waits until its slot may be written again."""
        if not link.shared:
            work = link.isend(dst, DATA)
            return work.wait
        link.isend(torch.tensor([version, k, slot], dtype=torch.int64), SIGNAL).wait()
        ack = torch.empty(1, dtype=torch.int64)
        work = link.irecv(ack, ACK)

        def done() -> None:
            work.wait()
            if int(ack[0]) != k:
                raise UpdateError(f"the replica acknowledged bucket {int(ack[0])}, expected {k}")
        return done

    def close(self) -> None:
        self.links.clear()
        for b in self.slots:
            b.close()


class P2PReceiver:
    """A replica's end: one link per trainer rank, two receive buffers for buckets that cross the wire."""

    def __init__(self, plan: BucketPlan, timeout_s: float = 120) -> None:
        self.timeout_s = timeout_s
        self.links: dict[int, Link] = {}
        self.slots: dict[int, list[torch.Tensor]] = {}  # a same-node sender's slots, mapped
        size = plan.bucket_bytes + TRAILER
        self.buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]

    def connect(self, rank: int, endpoint: Endpoint, replica: int, key: str | None = None) -> None:
        """Open the link to trainer rank ``rank`` (which calls ``P2PSender.connect`` with the same ``key`` at the same
        time)."""
        shared = endpoint.node == node_name()
        store = rendezvous_store(endpoint.host, endpoint.port, False, self.timeout_s)
        self.links[rank] = Link(store, key or str(replica), 1, shared, self.timeout_s)
        if shared:
            self.slots[rank] = [map_ipc(h) for h in endpoint.slots]

    def receive(self, plan: BucketPlan, version: int, receiver) -> None:
        """Take every bucket of update ``version`` and load it into ``receiver`` (a ``WeightReceiver``): a failed
        bucket rolls the update back, and the rest of the update is still drained so the senders finish."""
        n, posted = len(plan.buckets), {}
        failure: Exception | None = None

        def post(k: int) -> None:
            link = self.links[plan.owners[k]]
            if link.shared:
                word = torch.empty(3, dtype=torch.int64)
                posted[k] = (link.irecv(word, SIGNAL), word)
            else:
                buf = self.buffers[k % 2][: plan.used_bytes(k) + TRAILER]
                posted[k] = (link.irecv(buf, DATA), buf)

        if n:
            post(0)
        for k in range(n):
            work, got = posted.pop(k)
            work.wait()
            if k + 1 < n:
                post(k + 1)  # bucket k+1 arrives (in the other buffer) while this one loads
            link = self.links[plan.owners[k]]
            src = got
            if link.shared:
                got_version, got_bucket, slot = got.tolist()
                src = self.slots[plan.owners[k]][slot]
                if (got_version, got_bucket) != (version, k) and failure is None:
                    failure = UpdateError(f"the signal names bucket {got_bucket} of update {got_version}, expected "
                                          f"bucket {k} of update {version}")
                    receiver.rollback()
            if failure is None:
                try:
                    receiver.load_from(k, k % 2, src, version)
                except Exception as e:
                    failure = e
                    receiver.rollback()
            if link.shared:  # its slot is free again
                link.isend(torch.tensor([k], dtype=torch.int64), ACK).wait()
        if failure is not None:
            raise UpdateError(f"update {version} was not applied: {failure}") from failure

    def close(self) -> None:
        self.links.clear()
        self.slots.clear()

