"""The flash-attn backend: what can be checked without flash-attn on the CPU, and, where CUDA
and flash-attn are both present, its output against the sdpa backend."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from plugin_fakes import install_fake_plugin

from brigade.config import check_config, load_config
from brigade.errors import ConfigError
from brigade.interfaces import NoOptions
from brigade.plugins.attention.flash_attn import FlashAttentionBackend
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.registry import load_registry
from brigade.testing.attention import random_attention_case, run_backend


def _has_flash_attn() -> bool:
    try:
        FlashAttentionBackend.check_device("cuda")
    except RuntimeError:
        return False
    return True


needs_flash_attn = pytest.mark.skipif(
    not torch.cuda.is_available() or not _has_flash_attn(), reason="needs CUDA and flash-attn"
)


def test_importing_the_module_does_not_import_flash_attn() -> None:
    code = (
        "import sys, brigade.plugins.attention.flash_attn; "
        "sys.exit(1 if 'flash_attn' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_without_flash_attn_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from brigade.plugins.attention import flash_attn as module

    module._flash_attn.cache_clear()
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` fail
    try:
        with pytest.raises(RuntimeError, match=r"brigade-llm\[flash-attn\]"):
            FlashAttentionBackend.check_device("cuda")
    finally:
        module._flash_attn.cache_clear()


def test_page_sizes_are_multiples_of_256() -> None:
    rule = FlashAttentionBackend.supported_page_sizes(NoOptions())
    assert [size for size in (16, 128, 255, 256, 300, 512, 768) if rule.allows(size)] == [
        256,
        512,
        768,
    ]


def test_config_check_rejects_other_page_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_fake_plugin(
        monkeypatch, "brigade-fa-test", lambda r: r.add("attention", "fa", FlashAttentionBackend)
    )
    registry = load_registry()
    path = tmp_path / "engine.toml"
    path.write_text('[attention]\nplugin = "fa"\n[kv]\npage_size = 16\n')
    with pytest.raises(ConfigError, match=r"page_size = 16 .* 'fa'; it needs a multiple of 256"):
        check_config(load_config(path, registry), registry)
    path.write_text('[attention]\nplugin = "fa"\n[kv]\npage_size = 256\n')
    check_config(load_config(path, registry), registry)


@pytest.mark.gpu
@needs_flash_attn
@pytest.mark.parametrize("sliding_window", [None, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_sdpa_on_a_mixed_batch(sliding_window: int | None, dtype: torch.dtype) -> None:
    # decodes (mid-page, past a page boundary), a fresh prefill, and a chunk after a cached one
    case = random_attention_case(
        [1, 1, 1, 37, 9],
        [5, 300, 700, 0, 260],
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        page_size=256,
        sliding_window=sliding_window,
        dtype=dtype,
        device="cuda",
    )
    expected, expected_pool = run_backend(SdpaBackend(NoOptions()), case)
    output, pool = run_backend(FlashAttentionBackend(), case)
    torch.testing.assert_close(output, expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(pool[0], expected_pool[0])
    assert torch.equal(pool[1], expected_pool[1])
