"""Evals: avg@n and pass@k of environments' held-out examples against a served model, from the command line
(`asyncrl eval`, in `asyncrl/eval_command.py`: it starts a server and an inference client, which this package
does not import) or during `asyncrl rl` (`online.py`). docs/evals.md is the user's guide."""
