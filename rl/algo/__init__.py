"""The algorithm: the objectives (K1.5, GRPO, DAPO), the update they drive, mismatch correction, schedules."""
