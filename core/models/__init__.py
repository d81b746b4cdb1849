"""Model utilities: local creation of deterministic HF-format test models."""
