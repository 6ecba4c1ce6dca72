"""radixserve: a prefix-caching LLM inference server."""

from radixserve.engine.engine import Engine, EngineStats
from radixserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from radixserve.sampling.params import SamplingParams

__all__ = ["CompletionOutput", "Engine", "EngineStats", "RequestOutput", "SamplingParams", "TokenLogprob"]
__version__ = "0.1.0"
