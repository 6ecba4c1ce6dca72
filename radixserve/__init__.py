"""radixserve: a prefix-caching LLM inference server.

The public names are imported lazily, so light modules (the default-model converter, the protocol
types) do not pay for torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine
    from radixserve.engine.stats import EngineStats
    from radixserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
    from radixserve.sampling.params import SamplingParams

__all__ = ["CompletionOutput", "Engine", "EngineStats", "RequestOutput", "SamplingParams", "TokenLogprob"]
__version__ = "0.1.0"

_LOCATIONS = {
    "Engine": "radixserve.engine.engine",
    "EngineStats": "radixserve.engine.stats",
    "CompletionOutput": "radixserve.outputs",
    "RequestOutput": "radixserve.outputs",
    "TokenLogprob": "radixserve.outputs",
    "SamplingParams": "radixserve.sampling.params",
}


def __getattr__(name: str) -> Any:
    if name in _LOCATIONS:
        import importlib

        return getattr(importlib.import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
