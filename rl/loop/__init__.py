"""The loop: the controller, the Ray cluster and its two actors, weight sync, checkpoints, health and metrics."""
