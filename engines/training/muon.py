"""Muon that orthogonalises whole matrices when the parameters are FSDP2 shards (DTensor ``Shard(0)``).

The per-matrix rule is ``torch.optim.Muon``'s (momentum in lerp form, Nesterov, quintic Newton–Schulz
in bfloat16, decoupled weight decay, ``adjust_lr_fn``). Newton–Schulz is not row-separable, so for a
sharded matrix one owner rank gathers the full update, orthogonalises it and scatters the rows back;
owners are assigned per step by a deterministic size-balanced rule. Momentum stays sharded like the
parameter. Matrices of one shape are orthogonalised together with batched matmuls.
"""

from __future__ import annotations

import functools
import math
import os
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from engines.model.sharded import chunk_rows, is_row_sharded, local_tensor

try:
    from torch.optim._muon import _adjust_lr
except ImportError:  # the private helper moved: the same rule, written out
    def _adjust_lr(lr: float, adjust_lr_fn: str | None, param_shape: torch.Size) -> float:
        a, b = param_shape[:2]
        if adjust_lr_fn is None or adjust_lr_fn == "original":
            return lr * math.sqrt(max(1, a / b))
        if adjust_lr_fn == "match_rms_adamw":
            return lr * 0.2 * math.sqrt(max(a, b))
        return lr

#: Upper bound on one batched Newton–Schulz call's input per device type. On CPU, batches past a few
#: MiB leave the caches and measured slower than one matrix at a time; accelerators want large batches.
MAX_BATCH_BYTES = {"cpu": 4 << 20}
DEFAULT_MAX_BATCH_BYTES = 256 << 20


#: Set to 1 to keep torch's bfloat16 kernels on every device: torch.optim.Muon's exact results, at their speed.
BF16_KERNELS_ENV = "MUON_BF16_KERNELS"


@functools.cache
def native_bf16_matmul(device_type: str) -> bool:
    """Whether ``device_type``'s bfloat16 matmuls run on native kernels. A CPU without AVX-512 (AVX2 only) has
    none: torch falls back to a scalar loop measured at ~1 GFLOP/s, over 100x slower than its float32 GEMM."""
    return device_type != "cpu" or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def emulate_bf16_matmul(device_type: str) -> bool:
    """Whether Newton–Schulz emulates its bfloat16 matmuls in float32 on ``device_type`` by default."""
    return os.environ.get(BF16_KERNELS_ENV) != "1" and not native_bf16_matmul(device_type)


def _round_bf16_(t: Tensor) -> Tensor:
    return t.copy_(t.to(torch.bfloat16))


def newton_schulz_(x: Tensor, ns_coefficients: Sequence[float], ns_steps: int, eps: float,
                   emulate: bool | None = None) -> Tensor:
    """Orthogonalise every matrix of bfloat16 ``x`` [B, n, m] as ``torch.optim.Muon`` does; overwrites ``x``.

    Returns a bfloat16 [B, n, m] result (possibly a transposed view). The iteration runs in four
    preallocated buffers, since fresh allocations per matmul cost page faults on CPU. ``emulate`` (default:
    where ``emulate_bf16_matmul``) runs each matmul in float32 on the bfloat16 values and rounds its
    result to bfloat16, what a native bfloat16 GEMM does (float32 accumulation, one rounding): the same
    iteration up to the order of the float32 sums, at float32 GEMM speed.
    """
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if x.ndim != 3 or x.dtype not in (torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"expected a bfloat16, float32 or float64 batch of matrices [B, n, m], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    if x.dtype != torch.bfloat16:  # ``ShardedMuon(ns_dtype=float32)``: that dtype throughout, nothing to emulate
        emulate = False
    elif emulate is None:
        emulate = emulate_bf16_matmul(x.device.type)
    a, b, c = ns_coefficients
    tall = x.size(1) > x.size(2)
    y = x.mT if tall else x
    # one norm per matrix, each reduced exactly as the unbatched reference reduces it
    norms = torch.stack([m.norm() for m in y]).clamp(min=eps)
    y.div_(norms.view(-1, 1, 1))
    bsz, n, m = y.shape
    own = x.view(bsz, n, m) if x.is_contiguous() else None
    if emulate:
        y32 = y.float()
        gram, update, nxt = y32.new_empty(bsz, n, n), y32.new_empty(bsz, n, n), y32.new_empty(bsz, n, m)
        for _ in range(ns_steps):
            _round_bf16_(torch.bmm(y32, y32.mT, out=gram))
            _round_bf16_(torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=update))
            _round_bf16_(torch.baddbmm(y32, update, y32, beta=a, out=nxt))
            y32, nxt = nxt, y32
        y = (own if own is not None else y.new_empty(bsz, n, m)).copy_(y32)
        return y.mT if tall else y
    gram, update = y.new_empty(bsz, n, n), y.new_empty(bsz, n, n)
    # ping-pong between a new buffer and x's own storage, which is free once the first step read it
    iterates = [y.new_empty(bsz, n, m), own if own is not None else y.new_empty(bsz, n, m)]
    for k in range(ns_steps):
        torch.bmm(y, y.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=update)
        y = torch.baddbmm(y, update, y, beta=a, out=iterates[k % 2])
    return y.mT if tall else y


def orthogonalize(shapes: Sequence[tuple[int, int]], fill: Callable[[int, Tensor], None],
                  consume: Callable[[list[int], Tensor], None], ns_coefficients: Sequence[float], ns_steps: int,
                  eps: float, device: torch.device | str = "cpu", max_batch_bytes: int | None = None,
                  emulate: bool | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
    """Newton–Schulz of matrices ``i < len(shapes)``, batching those of equal shape (in ``dtype``: Muon's
    bfloat16, or float32 where a run must be exact to float32's precision).

    ``fill(i, slot)`` writes matrix i into a bfloat16 slot of ``shapes[i]`` (the cast is Muon's own);
    ``consume(idx, results)`` receives a batch's bfloat16 results [len(idx), *shape], ``results[k]`` matrix
    ``idx[k]``'s, valid until the next batch starts (one call per batch lets the caller batch its work too).
    """
    if max_batch_bytes is None:
        max_batch_bytes = MAX_BATCH_BYTES.get(torch.device(device).type, DEFAULT_MAX_BATCH_BYTES)
    by_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, shape in enumerate(shapes):
        by_shape[tuple(shape)].append(i)
    for shape, idx in by_shape.items():
        per_batch = max(1, max_batch_bytes // max(1, dtype.itemsize * shape[0] * shape[1]))
        for s in range(0, len(idx), per_batch):
            chunk = idx[s:s + per_batch]
            batch = torch.empty((len(chunk), *shape), dtype=dtype, device=device)
            for j, i in enumerate(chunk):
                fill(i, batch[j])
            consume(chunk, newton_schulz_(batch, ns_coefficients, ns_steps, eps, emulate))


def _nesterov_into(out: Tensor, grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> None:
    """Muon's update direction (before Newton–Schulz) written straight into ``out`` (cast on write)."""
    if nesterov:
        torch.lerp(grad, buf, momentum, out=out)
    else:
        out.copy_(buf)


def _sharded_mesh(p: Tensor):
    """The mesh when ``p`` is row-sharded across more than one rank; None when its local tensor is whole."""
    if not is_row_sharded(p):
        return None
    if p.device_mesh.ndim != 1:  # only stacked experts are sharded on a grid, and they hold whole matrices
        raise ValueError(f"Muon: a {p.ndim}-D parameter sharded over a {p.device_mesh.ndim}-D mesh is not supported")
    return p.device_mesh


def assign_owners(costs: Sequence[float], world: int) -> list[int]:
    """Owner rank of each matrix: largest first to the least-loaded rank (ties to the lower index)."""
    load = [0.0] * world
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` for plain and FSDP2-sharded 2-D parameters, and for stacked 3-D ones
    [batch, n, m] (MoE experts) whose every matrix is orthogonalised on its own; same arguments and state.

    For plain tensors (or a one-rank mesh) each step equals ``torch.optim.Muon``'s on each matrix. For
    ``Shard(0)`` DTensors every rank must step the same parameters (collectives run on the parameters'
    mesh); a sharded 3-D tensor holds whole matrices on each rank, so it needs no communication.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                 max_batch_bytes: int | None = None, ns_emulate: bool | None = None) -> None:
        # torch.optim.Muon refuses 3-D parameters: let it check the arguments on a 2-D stand-in, then
        # take its defaults for the real parameters
        probe = torch.optim.Muon([torch.empty(1, 1)], lr=lr, weight_decay=weight_decay, momentum=momentum,
                                 nesterov=nesterov, ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                                 adjust_lr_fn=adjust_lr_fn)
        torch.optim.Optimizer.__init__(self, params, probe.defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon takes matrices or stacks of matrices, got a parameter of size {p.size()}")
        # kept out of the param groups so the state dict stays interchangeable with torch.optim.Muon's;
        # None picks a size per device type (MAX_BATCH_BYTES)
        self.max_batch_bytes = max_batch_bytes
        # Newton–Schulz's matmuls: None emulates bfloat16 in float32 where the device has no bfloat16 GEMM
        # (newton_schulz_); False keeps torch.optim.Muon's bfloat16 kernels, and so its exact results
        self.ns_emulate = ns_emulate
        # Newton–Schulz's dtype: Muon's bfloat16, or float32 for comparisons that must hold to float32's precision
        # (two layouts of one model, whose gradients differ in the last bits, would otherwise differ by bf16 steps)
        self.ns_dtype = torch.bfloat16
        # Σ (Δw)² and the element count over this rank's shards of the last step (update RMS, a health metric);
        # the sum stays a device tensor: the caller reads it with the step's other values, in one wait
        self.last_update_sq: Tensor | float = 0.0
        self.last_update_numel = 0

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimisation step; collective when parameters are sharded."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update_sq: list[Tensor] = []
        self.last_update_numel = 0
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)
            if params:
                self._step_group(group, params, grads, bufs)
        self.last_update_sq = torch.cat(self._update_sq).sum() if self._update_sq else 0.0
        return loss

    def _step_group(self, group: dict, params: list[Tensor], grads: list[Tensor], bufs: list[Tensor]) -> None:
        lr = float(group["lr"])
        momentum, nesterov = group["momentum"], group["nesterov"]
        for g in grads:
            if g.ndim not in (2, 3):
                raise ValueError("Param gradient must be a 2D matrix or a 3D stack of matrices")
        p_loc, g_loc, b_loc = ([local_tensor(t) for t in ts] for ts in (params, grads, bufs))
        # elementwise momentum works shard by shard, no communication
        torch._foreach_lerp_(b_loc, g_loc, 1 - momentum)
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        decay = 1 - lr * group["weight_decay"]

        # each job is one matrix: (parameter, index in its stack or None); a stack's local matrices are whole
        whole: list[tuple[int, int | None]] = []
        by_mesh: dict[int, list[tuple[int, None]]] = defaultdict(list)
        meshes = {}
        for i, p in enumerate(params):
            if p.ndim == 3:
                whole += [(i, j) for j in range(p_loc[i].shape[0])]
                continue
            mesh = _sharded_mesh(p)
            if mesh is None:
                whole.append((i, None))
            else:
                want = (chunk_rows(p.shape[0], mesh.size())[mesh.get_local_rank()], p.shape[1])
                if tuple(p_loc[i].shape) != want or tuple(g_loc[i].shape) != want:
                    raise RuntimeError(f"local shard {tuple(p_loc[i].shape)} of a {tuple(p.shape)} matrix is not "
                                       f"its torch.chunk-style Shard(0) block {want}")
                by_mesh[id(mesh)].append((i, None))
                meshes[id(mesh)] = mesh

        def pick(t: Tensor, job: tuple[int, int | None]) -> Tensor:
            return t if job[1] is None else t[job[1]]

        def fill_local(job: tuple[int, int | None], out: Tensor) -> None:
            i = job[0]
            _nesterov_into(out, pick(g_loc[i], job), pick(b_loc[i], job), momentum, nesterov)

        def apply(jobs: list[tuple[int, int | None]], orthos: Tensor | Sequence[Tensor]) -> None:
            """Decay matrices ``jobs`` (of one shape, so one step size) and subtract their updates, a few launches
            for the whole batch rather than a few per matrix."""
            targets = [pick(p_loc[i], (i, j)) for i, j in jobs]
            step = _adjust_lr(lr, group["adjust_lr_fn"], params[jobs[0][0]].shape[-2:])
            ortho = (orthos if isinstance(orthos, Tensor) else torch.stack(list(orthos))).float()
            # the change this applies, Δ = (decay − 1)·w − step·O, measured before applying it (one sum per matrix)
            delta = torch.stack(targets).float().mul_(decay - 1).sub_(ortho, alpha=step)
            self._update_sq.append(delta.square_().sum(dim=(1, 2)))
            self.last_update_numel += sum(t.numel() for t in targets)
            torch._foreach_mul_(targets, decay)
            # a float32 target takes the float32 copy (the same values as bfloat16 O), one dtype for the fused path
            others = ortho.unbind(0) if targets[0].dtype == ortho.dtype else list(orthos)
            torch._foreach_add_(targets, others, alpha=-step)

        if whole:
            orthogonalize([tuple(pick(p_loc[i], (i, j)).shape) for i, j in whole],
                          lambda k, out: fill_local(whole[k], out), lambda ks, o: apply([whole[k] for k in ks], o), *ns,
                          device=p_loc[whole[0][0]].device, max_batch_bytes=self.max_batch_bytes,
                          emulate=self.ns_emulate, dtype=self.ns_dtype)
        for key, jobs in by_mesh.items():
            self._sharded_step(meshes[key], [tuple(params[i].shape) for i, _ in jobs],
                               lambda k, out, jobs=jobs: fill_local(jobs[k], out),
                               lambda ks, o, jobs=jobs: apply([jobs[k] for k in ks], o), ns,
                               p_loc[jobs[0][0]].device)

    def _sharded_step(self, mesh, shapes: list[tuple[int, int]], fill: Callable[[int, Tensor], None],
                      apply: Callable[[list[int], list[Tensor]], None], ns: tuple, device: torch.device) -> None:
        """Gather each full update to its owner, orthogonalise there, scatter the rows back and ``apply`` them.

        ``fill(j, out)`` writes this rank's rows of matrix j's update; ``apply(js, rows)`` takes this rank's rows
        of matrices ``js``, all of one shape; collective over ``mesh``.
        """
        pg, world, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        owners = assign_owners([r * c * min(r, c) for r, c in shapes], world)
        rows = [chunk_rows(r, world) for r, _ in shapes]
        owned = [[j for j, o in enumerate(owners) if o == r] for r in range(world)]
        # every rank's rows of matrix j sit in a padded slot of ceil(rows / world) rows of the owner's buffer
        slot: dict[int, int] = {}
        totals = [0] * world
        for r in range(world):
            for j in owned[r]:
                slot[j] = totals[r]
                totals[r] += max(rows[j]) * shapes[j][1]

        def rows_of(buf: Tensor, j: int, r: int) -> Tensor:
            return buf[slot[j]:slot[j] + rows[j][r] * shapes[j][1]].view(rows[j][r], shapes[j][1])

        # 1. gather to each owner (bfloat16 as Newton–Schulz casts anyway; sent as bytes for any backend)
        inbox: list[Tensor] = []
        works = []
        for r in range(world):
            if totals[r] == 0:
                continue
            send = torch.zeros(totals[r], dtype=self.ns_dtype, device=device)
            for j in owned[r]:
                fill(j, rows_of(send, j, rank))
            if r == rank:
                inbox = [torch.empty_like(send) for _ in range(world)]
            works.append(dist.gather(send.view(torch.uint8), [t.view(torch.uint8) for t in inbox] if r == rank
                                     else None, group=pg, group_dst=r, async_op=True))
        for w in works:
            w.wait()

        # 2. the owner orthogonalises its full matrices, writing each rank's rows into that rank's outbox
        mine = owned[rank]
        outbox = [torch.zeros(totals[rank], dtype=self.ns_dtype, device=device) for _ in range(world)]

        def fill_full(k: int, out: Tensor) -> None:
            j, start = mine[k], 0
            for r in range(world):
                out[start:start + rows[j][r]].copy_(rows_of(inbox[r], j, r))
                start += rows[j][r]

        def split_full(ks: list[int], orthos: Tensor) -> None:
            for k, ortho in zip(ks, orthos, strict=True):
                j, start = mine[k], 0
                for r in range(world):
                    rows_of(outbox[r], j, r).copy_(ortho[start:start + rows[j][r]])
                    start += rows[j][r]

        orthogonalize([shapes[j] for j in mine], fill_full, split_full, *ns, device=device,
                      max_batch_bytes=self.max_batch_bytes, emulate=self.ns_emulate, dtype=self.ns_dtype)

        # 3. scatter every rank's rows back and update the local shards
        received: dict[int, Tensor] = {}
        works = []
        for r in range(world):
            if totals[r] == 0:
                continue
            received[r] = torch.empty(totals[r], dtype=self.ns_dtype, device=device)
            works.append(dist.scatter(received[r].view(torch.uint8), [t.view(torch.uint8) for t in outbox]
                                      if r == rank else None, group=pg, group_src=r, async_op=True))
        for w in works:
            w.wait()
        same_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
        for j, shape in enumerate(shapes):
            same_shape[tuple(shape)].append(j)
        for js in same_shape.values():
            apply(js, [rows_of(received[owners[j]], j, rank) for j in js])
