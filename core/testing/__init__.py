"""Brigade's conformance kit: reusable checks any plugin author can run against a component.

- :mod:`brigade.testing.conformance` — ``check_*`` functions per contract; Brigade's own test suite
  runs them over every registered implementation.
- :mod:`brigade.testing.attention` — a naive attention reference and random ragged cases.
- :mod:`brigade.testing.parity` — tie-aware comparison of greedy token streams.
- :mod:`brigade.testing.requests` — requests for scheduler and KV tests, no model needed.
"""
