"""megadecode: a decode engine for extremely sparse Mixture-of-Experts models."""

from .config import ConfigError, ModelConfig, config_from_hf, load_config
from .engine import Engine, GenerationResult, RequestError
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["ConfigError", "Engine", "GenerationResult", "ModelConfig", "RequestError", "SamplingParams",
           "config_from_hf", "load_config"]
