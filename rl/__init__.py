"""The central controller, the RL algorithm, configs and the command line."""
