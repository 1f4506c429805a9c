"""Rollout and reward: task sets, the partial-rollout buffer, episodes in their environments, rewards, PTX data."""
