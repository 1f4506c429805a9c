"""Gym-style environments: the interface, the registry and the built-in environments."""

from envs.base import Env, Task
from envs.registry import make, register, register_gym_ids, registered

register_gym_ids()  # gymnasium.make("rl/NAME") works right after `import envs`

__all__ = ["Env", "Task", "make", "register", "registered"]
