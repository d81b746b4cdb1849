"""Built-in proposers of draft tokens for speculative decoding (``[speculative] plugin``)."""
