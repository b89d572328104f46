"""`asyncrl plan`: a model of the pipeline's step time for a split of GPUs (model.py), and its parts read
from a finished run (calibrate.py)."""
