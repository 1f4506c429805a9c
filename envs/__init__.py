"""Gym-style environments: the interface, the registry and the built-in environments."""

from envs.base import Env, Task
from envs.registry import make, register, registered

__all__ = ["Env", "Task", "make", "register", "registered"]
