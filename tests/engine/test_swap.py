"""Preemption by swap: pages go to host memory and back; outputs equal recompute's."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import assert_same_greedy, make_llm, prompts, run

from brigade.errors import ConfigError
from brigade.models.create import create_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model(tmp_path_factory.mktemp("m") / "llama", overrides={"num_hidden_layers": 2})


SMALL_POOL = ["kv.num_pages=16", "kv.enable_prefix_caching=false"]
"""16 pages of 4 tokens: about two of the test's sequences at once."""


def test_swap_and_recompute_give_the_roomy_pool_s_tokens(model_dir: Path) -> None:
    token_prompts = prompts([14, 9, 20, 11, 5, 16], seed=4)
    roomy = run(make_llm(model_dir), token_prompts)
    swap = make_llm(model_dir, *SMALL_POOL, 'scheduler.preemption="swap"')
    assert_same_greedy(run(swap, token_prompts), roomy, "swap")
    scheduler = swap.engine.scheduler
    assert scheduler.stats().num_preemptions > 0
    assert scheduler.swap is not None
    assert scheduler.swap.num_swapped_out > 0
    assert scheduler.swap.num_swapped_out == scheduler.swap.num_swapped_in
    assert swap.engine.kv.num_free_pages() == 16
    recompute = make_llm(model_dir, *SMALL_POOL)
    assert_same_greedy(run(recompute, token_prompts), roomy, "recompute")


def test_a_full_host_pool_falls_back_to_recompute(model_dir: Path) -> None:
    token_prompts = prompts([14, 9, 20, 11, 5, 16], seed=4)
    roomy = run(make_llm(model_dir), token_prompts)
    # 8 KiB pages (2 layers x K,V x 4 tokens x 2 heads x 64 x 4 bytes): room for 6 of them.
    tiny_swap = make_llm(
        model_dir, *SMALL_POOL, 'scheduler.preemption="swap"', "kv.swap_space_gib=0.0000458"
    )
    assert_same_greedy(run(tiny_swap, token_prompts), roomy, "swap with a tiny host pool")
    scheduler = tiny_swap.engine.scheduler
    assert scheduler.swap is not None
    assert scheduler.stats().num_preemptions > scheduler.swap.num_swapped_out


def test_swap_needs_an_executor_that_copies_pages(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from brigade.plugins.executors.torch_executor import TorchExecutor

    monkeypatch.setattr(TorchExecutor, "supports_copy_pages", False)
    with pytest.raises(ConfigError, match="preemption = 'swap' needs an executor"):
        make_llm(model_dir, 'scheduler.preemption="swap"')
