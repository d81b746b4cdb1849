"""Registers Brigade's built-in components (entry point ``brigade.builtins``)."""

from __future__ import annotations

from brigade.interfaces import ComponentRegistry, hookimpl
from brigade.plugins.attention.sdpa import SdpaBackend
from brigade.plugins.executors.torch_executor import TorchExecutor, TorchExecutorOptions
from brigade.plugins.models.architectures import ARCHITECTURES


@hookimpl
def brigade_register(registry: ComponentRegistry) -> None:
    """Add the built-in attention backend, executor and model architectures."""
    registry.add("attention", "sdpa", SdpaBackend)
    registry.add("executor", "torch", TorchExecutor, options=TorchExecutorOptions)
    for hf_name, architecture in ARCHITECTURES.items():
        registry.add("model", hf_name, architecture)
