"""Before a run: memory estimates and plans, the warm start, the difficulty filter."""
