"""The native model families: one normalised architecture spec, the shared model code (attention, MoE, RoPE, layers)
both engines run, and its block-FP8 replicas."""
