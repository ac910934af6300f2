"""Run monitoring: metrics to console, JSONL and TensorBoard."""
