"""Brigade: an LLM serving engine whose every part is a swappable plugin.

``from brigade import LLM, SamplingParams`` is the offline API; importing the package stays
light (torch loads when ``LLM`` is first used).
"""

from typing import TYPE_CHECKING, Any

from brigade.interfaces import SamplingParams

if TYPE_CHECKING:
    from brigade.llm import LLM
    from brigade.output import CompletionOutput, RequestOutput

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "CompletionOutput", "RequestOutput"):
        from brigade import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'brigade' has no attribute {name!r}")
