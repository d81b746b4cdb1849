"""Built-in routers over data-parallel replicas (``[router] plugin``)."""
