"""The orchestrator: samples examples, gets rollouts from inference, scores them, computes advantages,
keeps the off-policy bound, and writes packed batches for the trainer."""
