"""Weight transfer from the training engine to the inference engines through shared buffers."""
