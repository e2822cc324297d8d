"""Runs inside tritonserver's Python backend stub (backend/model.py and the ensemble's models import it), and in
the engine core process a stub may start (engine_core.py)."""
