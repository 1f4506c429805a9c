"""One HTTP POST with retries, as the reward endpoint and the LLM judge send theirs.

A connection error, a timeout or status 408, 429 or 5xx is retried up to ``retries`` times, waiting ``BACKOFF_S``,
then twice that, and so on between attempts; another status fails at once, since asking again would get the same
answer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

BACKOFF_S = 0.5
RETRY_STATUS = frozenset({408, 429})


def post_with_retries(url: str, *, timeout_s: float, retries: int,
                      **request: Any) -> tuple[httpx.Response | None, str | None, int]:
    """POST ``request`` (httpx.post's keywords: ``json``/``content``, ``headers``) to ``url`` until it is answered
    200 or fails for good: (the 200 response or None, the last error or None, the attempts made)."""
    import httpx

    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    error = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
        try:
            r = httpx.post(url, timeout=timeout_s, **request)
        except httpx.TimeoutException:
            error = f"no reply from {url} within {timeout_s:g} s"
            continue
        except httpx.HTTPError as e:
            error = f"cannot reach {url}: {type(e).__name__}: {e}"
            continue
        if r.status_code == 200:
            return r, None, attempt + 1
        error = f"{url} answered {r.status_code}: {r.text[:200]!r}"
        if r.status_code not in RETRY_STATUS and r.status_code < 500:
            break
    return None, error, attempt + 1


def after(error: str, attempts: int) -> str:
    """``error`` with how many attempts it took, as both callers report a request that failed."""
    return f"{error} (after {attempts} attempt{'s' * (attempts > 1)})"
