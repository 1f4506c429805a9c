"""Partial rollout (Kimi K1.5/K2): a fixed rollout token budget per iteration.

Trajectories still generating when the budget is spent are paused with their tokens and
per-token logprobs, and continue in the next iteration under the new weights; each stretch of
tokens is a segment tagged with the weights version that sampled it, so π_old of every token is
the policy that actually drew it. Trajectories older than ``max_age`` iterations are dropped, and
a prompt group is handed to the trainer once every remaining sample of it has finished. Samples are
``rl.sample.Sample`` records; a multi-turn episode's turns go through the same buffer and budget (its
environment stays with the driver, ``rl.rollout.multiturn``). The buffer is checkpointed as arrays (``save_state``:
one ``.npz`` of the samples' token data concatenated, with offsets, and a small JSON header); checkpoints of the
earlier JSON formats are still read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from engines.inference.sampling import SamplingParams
from engines.model.images import ImageRef
from rl.sample import LOGPROBS, MASK, TOKENS, Sample, TaskType, TurnResult

__all__ = ["PartialRolloutBuffer", "load_state", "save_state"]


_STAT_KEYS = ("resumed", "dropped")


class PartialRolloutBuffer:
    """The samples of prompt groups that are not complete yet, across iterations.

    Per iteration: ``pending(it)`` (drops the too old, lists what to run), generate, ``record`` the results,
    ``pop_complete()`` the groups to train on. Counters for ``stats()`` are reset by the first ``pending`` call of
    each new iteration. Multi-turn samples between turns are held here too; their environments are not (they live
    with the driver's episode runner), so a checkpoint cannot carry them: ``drop_in_flight_episodes`` ends them
    before a save, in every run alike, which keeps a resumed run exact.
    """

    def __init__(self, max_age: int) -> None:
        if max_age < 0:
            raise ValueError(f"max_age must be >= 0, got {max_age}")
        self.max_age = max_age
        self._groups: dict[int, list[Sample]] = {}
        self._by_key: dict[int, Sample] = {}
        self._counts = dict.fromkeys(_STAT_KEYS, 0)
        self._iteration: int | None = None  # iteration the counters belong to

    def add_group(self, samples: Sequence[Sample]) -> None:
        """Register the new samples of one prompt group."""
        if not samples:
            raise ValueError("a group needs at least one sample")
        group = samples[0].group
        keys = [s.key for s in samples]
        if any(s.group != group for s in samples):
            raise ValueError(f"samples of one group must share its id; got {sorted({s.group for s in samples})}")
        if group in self._groups:
            raise ValueError(f"group {group} is already in the buffer")
        if len(set(keys)) != len(keys) or any(k in self._by_key for k in keys):
            raise ValueError(f"sample keys must be unique: {keys}")
        self._groups[group] = list(samples)
        self._by_key.update((s.key, s) for s in samples)

    def _drop(self, keys: set[int]) -> list[Sample]:
        """Remove the samples ``keys``; a group goes on with its other samples, or is gone if none is left."""
        dropped = [self._by_key.pop(k) for k in sorted(keys)]
        for g in {s.group for s in dropped}:
            keep = [s for s in self._groups[g] if s.key not in keys]
            if keep:
                self._groups[g] = keep
            else:
                del self._groups[g]
        self._counts["dropped"] += len(dropped)
        return dropped

    def pending(self, iteration: int) -> tuple[list[Sample], list[Sample]]:
        """(to run, dropped): unfinished samples, oldest first, and those removed because
        ``iteration - started > max_age``. Starts the counters of ``iteration`` if new."""
        if iteration != self._iteration:
            self._iteration = iteration
            self._counts = dict.fromkeys(_STAT_KEYS, 0)
        unfinished = [s for g in sorted(self._groups) for s in self._groups[g] if not s.done]
        dropped = self._drop({s.key for s in unfinished if iteration - s.started > self.max_age})
        gone = {s.key for s in dropped}
        run = sorted((s for s in unfinished if s.key not in gone), key=lambda s: (s.started, s.key))
        self._counts["resumed"] += sum(s.started < iteration for s in run)
        return run, dropped

    def record(self, results: Sequence[TurnResult]) -> None:
        """Take a round's results back (matched by key; ``rl.rollout.turns.serve_turns`` makes them): each appends its
        new tokens to the held sample in place (``Sample.take``: the buffer's samples are the records)."""
        for r in results:
            s = self._by_key.get(r.key)
            if s is None:
                raise KeyError(f"no sample with key {r.key} in the buffer")
            s.take(r)

    def get(self, key: int) -> Sample:
        """The sample ``key`` as held now."""
        return self._by_key[key]

    def pop_complete(self) -> list[list[Sample]]:
        """Remove and return the groups whose every remaining sample has ended, by group id."""
        out = []
        for g in sorted(self._groups):
            if all(s.done for s in self._groups[g]):
                members = self._groups.pop(g)
                for s in members:
                    del self._by_key[s.key]
                out.append(members)
        return out

    def drop_in_flight_episodes(self) -> list[Sample]:
        """Remove the multi-turn samples not yet ended (their environments cannot be saved); returns them."""
        return self._drop({k for k, s in self._by_key.items() if s.multi_turn and not s.done})

    def in_flight_groups(self) -> int:
        """Groups held: some sample still unfinished, or complete but not yet popped."""
        return len(self._groups)

    def stats(self) -> dict[str, int]:
        """The current iteration's counters (reset by its first ``pending``): ``resumed`` samples drawn in an
        earlier iteration that ran in this one, ``dropped`` for age or a checkpoint; and, now: ``paused``, the
        samples waiting for the next iteration (mid-turn, or a multi-turn episode between turns), and
        ``waiting_groups`` (call after ``pop_complete``)."""
        paused = sum(not s.done for s in self._by_key.values())
        return {"paused": paused, **self._counts, "waiting_groups": len(self._groups)}

    def state_dict(self) -> dict[str, Any]:
        """The state for checkpoints: a JSON-serialisable header and, under "arrays", the samples' token data
        concatenated with offsets (``save_state`` writes it into one file)."""
        samples = [s for g in sorted(self._groups) for s in self._groups[g]]
        return {"format": ARRAYS_FORMAT, "max_age": self.max_age, "iteration": self._iteration,
                "counts": dict(self._counts), "samples": [_header(s) for s in samples], "arrays": _pack(samples)}

    def load_state_dict(self, state: dict[str, Any], type_of: Callable[[int], TaskType] | None = None) -> None:
        """Replace this buffer's contents with a ``state_dict`` (or ``load_state``'s), or with the state of a
        checkpoint written before arrays (JSON, also after a JSON round trip). Checkpoints written before samples
        carried their task type hold trajectories; ``type_of(task_index)`` types them."""
        self.max_age = int(state["max_age"])
        self._iteration = state["iteration"]
        self._counts = {k: int(state["counts"].get(k, 0)) for k in _STAT_KEYS}
        self._groups, self._by_key = {}, {}
        if "arrays" in state:
            groups: dict[int, list[Sample]] = {}
            for s in _unpack(state["samples"], state["arrays"]):
                groups.setdefault(s.group, []).append(s)
            for members in groups.values():
                self.add_group(members)
            return
        for members in state["groups"]:
            self.add_group([Sample.from_dict(d) if "task_type" in d else _from_trajectory(d, type_of)
                            for d in members])


ARRAYS_FORMAT = 2  # the "format" of a state with arrays (the JSON ones before it had none)
_HEADER = "header"  # the npz entry holding the JSON header (as UTF-8 bytes)
_SCALARS = ("key", "group", "task_index", "started", "multi_turn", "turn_start", "turns", "status", "reward", "error")


def _header(s: Sample) -> dict[str, Any]:
    """What of a sample is not token data, JSON-serialisable."""
    return {**{k: getattr(s, k) for k in _SCALARS}, "task_type": asdict(s.task_type), "params": asdict(s.params),
            "masked": s.loss_mask is not None, "routed": s.routed_experts is not None,
            # an image file by its path; an image's bytes as an array of their own (``image.<sample>.<n>``)
            "images": [{"path": im.path} if im.path is not None else None for im in s.images]}


def _offsets(lengths: list[int]) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).astype(np.int64)


def _cat(parts: list[np.ndarray], dtype: type, shape: tuple[int, ...] = ()) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros((0, *shape), dtype)


def _pack(samples: list[Sample]) -> dict[str, np.ndarray]:
    """The samples' token data, each kind concatenated over the samples, with the offsets of each sample's part."""
    out = {"prompt_ids": _cat([s.prompt_ids for s in samples], TOKENS),
           "prompt_offsets": _offsets([len(s.prompt_ids) for s in samples]),
           "response_ids": _cat([s.response_ids for s in samples], TOKENS),
           "logprobs": _cat([s.logprobs for s in samples], LOGPROBS),
           # a sample without a mask (all its tokens its own) is stored as ones; its header says None
           "loss_mask": _cat([np.ones(len(s.response_ids), MASK) if s.loss_mask is None else s.loss_mask
                              for s in samples], MASK),
           "response_offsets": _offsets([len(s.response_ids) for s in samples]),
           "segments": _cat([s.segments for s in samples], TOKENS, (2,)),
           "segment_offsets": _offsets([len(s.segments) for s in samples])}
    for i, s in enumerate(samples):
        if s.routed_experts is not None:
            out[f"routed_experts.{i}"] = np.asarray(s.routed_experts)
        for j, im in enumerate(s.images):
            if im.data is not None:
                out[f"image.{i}.{j}"] = np.frombuffer(im.data, np.uint8)
    return out


def _unpack(headers: list[dict[str, Any]], arrays: dict[str, np.ndarray]) -> list[Sample]:
    """Inverse of ``_header`` and ``_pack``."""
    po, ro, so = (arrays[k].tolist() for k in ("prompt_offsets", "response_offsets", "segment_offsets"))
    if not len(po) == len(ro) == len(so) == len(headers) + 1:
        raise ValueError(f"partial-rollout state: {len(headers)} samples but offsets for {len(po) - 1}, "
                         f"{len(ro) - 1}, {len(so) - 1}")
    out = []
    for i, h in enumerate(headers):
        r = slice(ro[i], ro[i + 1])
        s = Sample(h["key"], h["group"], h["task_index"], TaskType.from_dict(h["task_type"]),
                   arrays["prompt_ids"][po[i]:po[i + 1]], SamplingParams(**h["params"]), h["started"],
                   arrays["response_ids"][r], arrays["logprobs"][r],
                   loss_mask=arrays["loss_mask"][r] if h["masked"] else None,
                   segments=arrays["segments"][so[i]:so[i + 1]],
                   **{k: h[k] for k in _SCALARS[4:]})
        if h["routed"]:
            s.routed_experts = arrays[f"routed_experts.{i}"]
        s.images = tuple(ImageRef(path=im["path"], where=f"sample {s.key} image {j}") if im is not None else
                         ImageRef(data=arrays[f"image.{i}.{j}"].tobytes(), where=f"sample {s.key} image {j}")
                         for j, im in enumerate(h.get("images", ())))
        out.append(s)
    return out


def save_state(state: dict[str, Any], path: Path) -> None:
    """Write a ``state_dict`` into one uncompressed ``.npz`` file: its arrays, and its header as JSON."""
    header = json.dumps({k: v for k, v in state.items() if k != "arrays"}).encode()
    with open(path, "wb") as f:
        np.savez(f, **{_HEADER: np.frombuffer(header, np.uint8)}, **state["arrays"])


def load_state(path: Path) -> dict[str, Any]:
    """The ``state_dict`` that ``save_state`` wrote into ``path``, exactly."""
    with np.load(path, allow_pickle=False) as z:
        if _HEADER not in z.files:
            raise ValueError(f"{path} is not a partial-rollout state (no {_HEADER!r} entry)")
        header = json.loads(z[_HEADER].tobytes().decode())
        return {**header, "arrays": {k: z[k] for k in z.files if k != _HEADER}}


def _from_trajectory(d: dict, type_of: Callable[[int], TaskType] | None) -> Sample:
    """A paused trajectory of an earlier checkpoint format as a sample."""
    if type_of is None:
        raise ValueError("a checkpoint of the earlier format needs type_of to give its trajectories a task type")
    status = "paused" if d["finish_reason"] is None else "error" if d["finish_reason"] == "error" else \
        "truncated" if d["finish_reason"] == "length" else "finished"
    return Sample(d["key"], d["group"], d["task_index"], type_of(d["task_index"]), list(d["prompt_ids"]),
                  SamplingParams(**d["params"]), d["started"], list(d["token_ids"]), list(d["logprobs"]),
                  segments=[(int(a), int(b)) for a, b in d["segments"]], status=status, error=d.get("error"))
