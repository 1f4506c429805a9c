"""The training engine: FSDP2 sharding, packed batches, host offload and trainer state."""
