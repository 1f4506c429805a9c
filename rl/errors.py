"""Errors caused by the user's input: the CLI prints their message alone and exits non-zero."""


class UserError(Exception):
    """Bad input (config, paths, data); the message names the problem and how to fix it."""
