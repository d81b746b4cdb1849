"""Built-in detokenizers."""
