"""Driving a weight update across Ray actors: a two-stage pipeline over two IPC buffers."""

from __future__ import annotations

import ray


def push_weights(sender, receivers: list, num_buckets: int, on_bucket=None) -> None:
    """Fill bucket k into buffer k mod 2 while every receiver loads bucket k−1 from the other.

    ``sender`` exposes ``fill(bucket, buffer)`` and each receiver ``load(bucket, buffer)`` as Ray
    actor methods; ``on_bucket`` is called after each bucket is loaded everywhere (progress).
    """
    for k in range(num_buckets + 1):
        calls = []
        if k < num_buckets:
            calls.append(sender.fill.remote(k, k % 2))
        if k > 0:
            calls += [r.load_bucket.remote(k - 1, (k - 1) % 2) for r in receivers]
        ray.get(calls)
        if k > 0 and on_bucket is not None:
            on_bucket()
