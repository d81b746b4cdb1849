"""The persistent batch lays a step's rows out decodes first, whatever the serving order."""

from __future__ import annotations

import torch

from brigade.interfaces import KVPoolParams, ScheduledRequest
from brigade.model_input import SeqChunk, build_model_input
from brigade.persistent_batch import PersistentBatch
from brigade.plugins.kv.paged import PagedKVManager, PagedKVOptions
from brigade.testing.requests import make_request

PAGE = 4


def test_decode_rows_come_first_and_match_the_reference_builder() -> None:
    kv = PagedKVManager(KVPoolParams(32, PAGE, enable_prefix_caching=False), PagedKVOptions())
    batch = PersistentBatch(max_num_seqs=4, max_model_len=64, page_size=PAGE, max_num_tokens=64)
    decoding = make_request("decoding", [1, 2, 3, 4, 5])
    decoding.output_token_ids.append(9)
    decoding.num_computed_tokens = 5  # its sixth token (9) is the decode
    prefilling = make_request("prefilling", [6, 7, 8])
    for request, num_new in ((decoding, 1), (prefilling, 3)):
        assert kv.allocate(request, num_new) is not None
        batch.assign(request, None)
    # Serving order puts the prefill first (a policy may order rows any way it likes).
    scheduled = [ScheduledRequest(prefilling, 3), ScheduledRequest(decoding, 1)]
    assert [item.is_decode for item in scheduled] == [False, True]
    plan = batch.prepare(scheduled, kv)
    model_input = plan.model_input
    assert model_input.num_decodes == 1
    assert plan.sampled == (decoding, prefilling)  # logits rows follow the layout
    reference = build_model_input(
        [
            SeqChunk([9], 5, list(kv.block_table(decoding))),
            SeqChunk([6, 7, 8], 0, list(kv.block_table(prefilling))),
        ],
        PAGE,
    )
    for field in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens"):
        assert torch.equal(
            getattr(model_input, field).to(torch.int64), getattr(reference, field).to(torch.int64)
        ), field
