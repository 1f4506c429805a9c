"""Errors the CLI reports in one line, without a traceback: a usage error (exit code 2) or a command that was used
correctly and failed (exit code 1)."""


class UserError(Exception):
    """Bad input (config, paths, data, arguments); the message names the problem and how to fix it. Exit code 2."""


class CommandFailed(Exception):
    """A correctly given command that failed at run time (a cluster unreachable, a run that does not exist, an
    install the cluster refused); the message says what failed and where. Exit code 1."""


class TrainingStopped(CommandFailed):
    """The run cannot go on: the message names the cause. The last checkpoint is left as it was."""


def worker_startup_error(err: BaseException) -> CommandFailed | None:
    """``err`` as one line (a ``CommandFailed``) where it is Ray's report of a worker that died in its constructor
    (``ray.exceptions.RayActorError`` of a failed creation task, e.g. a rollout replica that cannot serve the model,
    ``engines.inference.replica_check``); None for any other error. Ray carries the worker's error to the driver as
    the text of its traceback only, whose last line is the error itself: that line, less its class's module path;
    the whole traceback stays in the worker's log."""
    import ray

    if not isinstance(err, ray.exceptions.RayActorError) or not getattr(err, "actor_init_failed", False):
        return None
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    last = lines[-1] if lines else "(no message)"
    kind, sep, message = last.partition(": ")
    if sep and " " not in kind:  # "package.module.ErrorClass: message"
        last = f"{kind.rpartition('.')[2]}: {message}"
    return CommandFailed(f"a worker failed to start: {last}")
