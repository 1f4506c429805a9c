"""LoRA adapters in PEFT's conventions: the trainer's adapted layers, a QLoRA base, and the serving side's merge and
low-rank deltas."""
