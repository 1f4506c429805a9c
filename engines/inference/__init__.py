"""Inference engines behind one interface (``engines.inference.base``): the native engine, vLLM, and the server."""
