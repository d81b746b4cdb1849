"""Built-in Brigade components, registered through the same entry points as third-party ones."""
