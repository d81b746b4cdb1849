"""Built-in KV managers. What other plugins may use is exported here (the prefix hashing a
cache-aware router shares with the managers); the modules are this package's own."""

from __future__ import annotations

from brigade.plugins.kv.paged import ROOT_PAGE_DIGEST, hash_page

__all__ = ["ROOT_PAGE_DIGEST", "hash_page"]
