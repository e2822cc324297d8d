"""Runs in the `nanoserve serve` process (and in whatever else starts a tritonserver: the demo, tests,
benchmarks): the preflight checks, the tritonserver process, its supervisor, liveness probes and drain."""
