"""Checkpoints and where they live: Hugging Face directories (read, write, rank-local reads), model sources
(hub, object storage) and uploads."""
