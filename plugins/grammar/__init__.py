"""Built-in grammar backends (the structured-output station)."""
