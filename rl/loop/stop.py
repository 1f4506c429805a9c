"""A stop asked of the run from outside, and the safe points where the loop answers it.

The chart's ``preStop`` writes ``stop-requested`` in the run directory when a pod of the run is going away (a drain,
a spot notice) and waits, for the pod's grace period, until the run removes it. The loop answers at two points:

* after an iteration: its checkpoint is saved (whatever ``run.save_every`` says) and the run ends;
* while the trainers wait on the rollout phase (the replicas generating or rewarding the iteration's batch, or, in a
  disaggregated run, the stream's batch not yet made): the trainers still hold the state the iteration started from,
  so the iteration is abandoned, that state is saved as the previous iteration's checkpoint (unless it is on disk
  already) and the run ends. A resumed run repeats the abandoned iteration exactly: its draws and sampling seeds
  depend only on the run's seed and the iteration.

A stop therefore waits for at most one training phase, its weight update (and a held-out evaluation when one is
due), and one save; rollout, usually most of an iteration, is never waited for.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

STOP_FILE = "stop-requested"
STOP_POLL_S = 1.0  # how often a wait of the loop looks for a request (seconds)


class StopRequested(Exception):
    """Raised in a wait of the rollout phase once a stop was asked: the iteration in flight is abandoned."""


class StopWatch:
    """Whether a stop was asked (``run_dir / STOP_FILE`` exists), checked in the loop's waits while armed."""

    def __init__(self, run_dir: Path | None) -> None:
        """``run_dir``: where the request appears; None: stops are not answered (``run.checkpoint_on_stop`` off)."""
        self.path = None if run_dir is None else run_dir / STOP_FILE
        self._armed = threading.Event()

    def asked(self) -> bool:
        """A stop was asked (also while not armed)."""
        return self.path is not None and self.path.exists()

    def answered(self) -> None:
        """The run saved what it had to: the waiting ``preStop`` may let its pod go."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def check(self) -> None:
        """Raise ``StopRequested`` if armed and a stop was asked: called by the waits on the replicas and the
        stream, on whichever thread they run."""
        if self._armed.is_set() and self.asked():
            raise StopRequested(str(self.path))

    @contextmanager
    def armed(self):
        """The block is a safe point to abandon: the trainers hold the state its iteration started from."""
        self._armed.set()
        try:
            yield
        finally:
            self._armed.clear()
