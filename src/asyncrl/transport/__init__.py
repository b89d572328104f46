"""How the processes hand data to each other: rollout batches (orchestrator → trainer) and weights
(trainer → inference), both as files with an atomic rename and a version number."""
