"""A sampler, a logits processor and an attention backend for Brigade, in plain torch."""

from brigade_example_stations.attention import GatherSdpaBackend
from brigade_example_stations.repeat_last_n import RepeatLastNOptions, RepeatLastNProcessor
from brigade_example_stations.sampler import PlainTorchSampler

__all__ = ["GatherSdpaBackend", "PlainTorchSampler", "RepeatLastNOptions", "RepeatLastNProcessor"]
