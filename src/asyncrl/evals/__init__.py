"""Evals: avg@n and pass@k of environments' held-out examples against a served model, from the command line
(`asyncrl eval`, `run.py`) or during `asyncrl rl` (`online.py`). docs/evals.md is the user's guide."""
