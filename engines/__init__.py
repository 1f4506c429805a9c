"""Model definition shared by both engines, the inference engine and the training engine."""
