"""Conversions between the protobuf messages and the backend's dataclasses (one place, used by server and client)."""

from __future__ import annotations

from sandbox.backend import ExecResult, Limits, Verdict
from sandbox.proto import sandbox_pb2 as pb

_LIMIT_FIELDS = tuple(Limits.__dataclass_fields__)


def limits_to_pb(limits: Limits | None) -> pb.Limits:
    """A Limits message (None → all zeros, i.e. the server's defaults)."""
    if limits is None:
        return pb.Limits()
    return pb.Limits(**{k: getattr(limits, k) for k in _LIMIT_FIELDS})


def limits_from_pb(msg: pb.Limits) -> dict[str, float | int]:
    """The fields a request set (non-zero), to merge over the server's defaults."""
    return {k: getattr(msg, k) for k in _LIMIT_FIELDS if getattr(msg, k)}


def result_to_pb(r: ExecResult) -> pb.ExecResult:
    """ExecResult → message."""
    msg = pb.ExecResult(verdict=pb.Verdict.Value(r.verdict.name), stdout=r.stdout, stderr=r.stderr,
                        stdout_truncated=r.stdout_truncated, stderr_truncated=r.stderr_truncated,
                        wall_s=r.wall_s, cpu_s=r.cpu_s, detail=r.detail, oom_kills=r.oom_kills)
    if r.exit_code is not None:
        msg.exit_code = r.exit_code
    if r.signal is not None:
        msg.signal = r.signal
    return msg


def result_from_pb(msg: pb.ExecResult) -> ExecResult:
    """Message → ExecResult."""
    return ExecResult(verdict=Verdict[pb.Verdict.Name(msg.verdict)],
                      exit_code=msg.exit_code if msg.HasField("exit_code") else None,
                      signal=msg.signal if msg.HasField("signal") else None,
                      stdout=msg.stdout, stderr=msg.stderr, stdout_truncated=msg.stdout_truncated,
                      stderr_truncated=msg.stderr_truncated, wall_s=msg.wall_s, cpu_s=msg.cpu_s, detail=msg.detail,
                      oom_kills=msg.oom_kills)


def files_to_pb(files: dict[str, bytes | str] | None, executable: frozenset[str] = frozenset()) -> list[pb.File]:
    """{path: content} → File messages (str content is UTF-8 encoded)."""
    return [pb.File(path=p, content=c.encode() if isinstance(c, str) else c, executable=p in executable)
            for p, c in (files or {}).items()]


def files_from_pb(files) -> tuple[dict[str, bytes], frozenset[str]]:
    """File messages → ({path: content}, executable paths)."""
    return {f.path: f.content for f in files}, frozenset(f.path for f in files if f.executable)
