"""Conformance checks: the behaviour every implementation of a contract must show.

Each ``check_*`` function raises ``AssertionError`` with a reason on the first violation, so
it works in any test runner::

    def test_my_backend_conforms():
        check_attention_backend(MyBackend(MyOptions()))

Brigade runs the same checks on every registered component
(``tests/plugin_api/test_conformance.py``).
"""

from brigade.testing.conformance.detokenizer import DETOKENIZER_TEXTS, check_detokenizer
from brigade.testing.conformance.grammar import check_grammar_backend
from brigade.testing.conformance.kv import check_kv_manager
from brigade.testing.conformance.logits_processor import check_logits_processor
from brigade.testing.conformance.models import (
    ATTENTION_CASES,
    check_attention_backend,
    check_executor,
    check_model_architecture,
)
from brigade.testing.conformance.proposer import check_proposer
from brigade.testing.conformance.router import check_router
from brigade.testing.conformance.sampler import check_sampler, make_sampling_batch
from brigade.testing.conformance.scheduler import (
    PolicyReport,
    build_scheduler,
    check_scheduler,
    finish_step,
    simulate,
)

__all__ = [
    "ATTENTION_CASES",
    "DETOKENIZER_TEXTS",
    "PolicyReport",
    "build_scheduler",
    "check_attention_backend",
    "check_detokenizer",
    "check_executor",
    "check_grammar_backend",
    "check_kv_manager",
    "check_logits_processor",
    "check_model_architecture",
    "check_proposer",
    "check_router",
    "check_sampler",
    "check_scheduler",
    "finish_step",
    "make_sampling_batch",
    "simulate",
]
