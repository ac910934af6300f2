"""Training: the run config, the data pipeline and the loop."""
