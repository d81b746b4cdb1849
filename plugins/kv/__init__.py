"""Built-in KV managers."""
