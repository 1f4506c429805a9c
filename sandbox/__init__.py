"""Sandbox service: runs untrusted, model-written code over gRPC (local bubblewrap or Kubernetes pod backends)."""
