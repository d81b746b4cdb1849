"""Attention backends. What other plugins may use is exported here (the ``cpu`` backend in
``brigade.plugins.cpu`` builds on the reference ``sdpa`` backend); the modules are this
package's own."""

from __future__ import annotations

from brigade.plugins.attention.sdpa import SdpaBackend, SdpaMetadata

__all__ = ["SdpaBackend", "SdpaMetadata"]
