"""The gather-sdpa backend: Brigade's attention conformance suite, float32 and bfloat16."""

from __future__ import annotations

import torch
from brigade.interfaces import NoOptions
from brigade.testing.conformance import check_attention_backend

from brigade_example_stations import GatherSdpaBackend


def test_gather_sdpa_conforms() -> None:
    check_attention_backend(GatherSdpaBackend(NoOptions()))


def test_gather_sdpa_conforms_in_bfloat16() -> None:
    check_attention_backend(
        GatherSdpaBackend(NoOptions()), page_sizes=(16,), dtype=torch.bfloat16, atol=3e-2
    )
