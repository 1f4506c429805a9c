"""Errors the CLI reports in one line, without a traceback: a usage error (exit code 2) or a command that was used
correctly and failed (exit code 1)."""


class UserError(Exception):
    """Bad input (config, paths, data, arguments); the message names the problem and how to fix it. Exit code 2."""


class CommandFailed(Exception):
    """A correctly given command that failed at run time (a cluster unreachable, a run that does not exist, an
    install the cluster refused); the message says what failed and where. Exit code 1."""


class TrainingStopped(CommandFailed):
    """The run cannot go on: the message names the cause. The last checkpoint is left as it was."""
