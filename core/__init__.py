"""Brigade: an LLM serving engine whose every part is a swappable plugin."""

__version__ = "0.1.0"

__all__ = ["__version__"]
