"""kvstrata.runtime: the speculative-decoding engine (``LLM``) and its target model."""

from .config import CacheConfig, RunnerConfig
from .engine import LLM
from .outputs import RequestDelta, RequestOutput
from .sampling import SamplingParams

__all__ = ["CacheConfig", "LLM", "RequestDelta", "RequestOutput", "RunnerConfig",
           "SamplingParams"]
