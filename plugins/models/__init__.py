"""Model architectures: the decoder shared by Llama, Mistral, Qwen2 and Qwen3 (``decoder``),
its registration by Hugging Face architecture name (``architectures``) and its tensor-parallel
shards (``parallel``).

What other plugins may use is exported here; the modules are this package's own.
"""

from __future__ import annotations

from brigade.plugins.models.architectures import ARCHITECTURES, DecoderArchitecture
from brigade.plugins.models.parallel import KEY as TENSOR_PARALLEL_KEY
from brigade.plugins.models.parallel import TensorParallel

__all__ = ["ARCHITECTURES", "TENSOR_PARALLEL_KEY", "DecoderArchitecture", "TensorParallel"]
