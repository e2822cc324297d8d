"""Clients and benchmarks that talk to nanoserve in Triton (run as scripts or `python -m client.X`)."""
