"""Inference engines behind one interface (``engines.inference.base``): the native engine, and its server."""
