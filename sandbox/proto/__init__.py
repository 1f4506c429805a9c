"""Protocol buffers of the sandbox service. The *_pb2 modules are generated at install time (see setup.py)."""
