"""`asyncrl env-server`: environments' `respond()` and reward functions in worker processes, reached over HTTP
by a stand-in environment in the orchestrator (`remote.py`). docs/environments.md#env-servers is the guide."""
