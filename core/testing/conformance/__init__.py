"""Conformance checks: the behaviour every implementation of a contract must show.

Each ``check_*`` function raises ``AssertionError`` with a reason on the first violation, so
it works in any test runner::

    def test_my_backend_conforms():
        check_attention_backend(MyBackend(MyOptions()))

Brigade runs the same checks on every registered component (``tests/test_conformance.py``).
"""

from brigade.testing.conformance.models import (
    ATTENTION_CASES,
    check_attention_backend,
    check_executor,
    check_model_architecture,
)

__all__ = [
    "ATTENTION_CASES",
    "check_attention_backend",
    "check_executor",
    "check_model_architecture",
]
