"""Runs over several nodes: the layout and per-process configs (layout.py), the shared run folder
(run_folder.py), and what the schedulers run: an sbatch script (slurm.py) and Kubernetes manifests (k8s.py)."""
