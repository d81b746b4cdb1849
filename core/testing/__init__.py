"""Brigade's conformance kit: reusable checks any plugin author can run against a component.

- :mod:`brigade.testing.conformance` — pytest suites per contract, parametrized over every
  registered implementation (``pytest --pyargs brigade.testing.conformance``).
- :mod:`brigade.testing.attention` — a naive attention reference and random ragged cases.
- :mod:`brigade.testing.reference` — a minimal greedy decoding loop over any executor.
"""
