"""pdserve: LLM serving with prefill and decode disaggregated.

The offline API is imported lazily so that services which only need protobuf stubs or the
hashing function never pay for torch::

    from pdserve import LLM, SamplingParams
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
