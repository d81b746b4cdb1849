"""Built-in schedulers."""
