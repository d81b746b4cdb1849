"""Benchmark building blocks: seeded workloads and the simulated-executor driver."""
