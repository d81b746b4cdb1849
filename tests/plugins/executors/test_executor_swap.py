"""copy_pages across the device pool and the host (swap) pool."""

from __future__ import annotations

import pytest
import torch

from brigade.interfaces import ExecutorParams, NoOptions
from brigade.model_input import SeqChunk, build_model_input
from brigade.models.checkpoint import open_checkpoint
from brigade.models.create import create_model
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions

PAGE = 4


@pytest.fixture(scope="module")
def executor(tmp_path_factory: pytest.TempPathFactory) -> TorchExecutor:
    model = create_model(tmp_path_factory.mktemp("m") / "llama", overrides={"num_hidden_layers": 2})
    params = ExecutorParams(
        model_path=str(model),
        dtype="float32",
        attention=SdpaBackend(NoOptions()),
        page_size=PAGE,
        kv_cache_dtype="auto",
        max_model_len=0,
        checkpoint=open_checkpoint(str(model)),
    )
    executor = TorchExecutor(params, TorchExecutorOptions(device="cpu"))
    executor.initialize_kv_cache(8, num_host_pages=4)
    return executor


def test_pages_survive_a_round_trip_through_host_memory(executor: TorchExecutor) -> None:
    prompt = [5, 17, 9, 3, 11, 40, 2]
    executor.execute(build_model_input([SeqChunk(prompt, 0, [6, 1])], PAGE))
    decode = build_model_input([SeqChunk([8], len(prompt), [6, 1])], PAGE)
    expected = executor.execute(decode)
    executor.copy_pages([6, 1], [8 + 2, 8 + 0])  # device -> host pages 10 and 8
    executor.copy_pages([0, 7], [6, 1])  # clobber the originals with other pages
    executor.copy_pages([10, 8], [3, 5])  # host -> new device pages
    moved = build_model_input([SeqChunk([8], len(prompt), [3, 5])], PAGE)
    torch.testing.assert_close(executor.execute(moved), expected, atol=0, rtol=0)


def test_copy_pages_refuses_ids_outside_both_pools(executor: TorchExecutor) -> None:
    with pytest.raises(ValueError, match=r"page ids must be in \[0, 12\)"):
        executor.copy_pages([0], [12])
    with pytest.raises(ValueError, match="2 source pages but 1"):
        executor.copy_pages([0, 1], [2])
