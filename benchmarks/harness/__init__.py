"""Harnesses the benchmarks and tests share: N checkpoint-engine ranks in processes, synthetic parameter sets and
their references, one sender in a child process for an engine held in the caller's."""
