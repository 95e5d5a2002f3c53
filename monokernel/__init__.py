"""monokernel: a whole Llama-family decode step as one persistent CUDA megakernel.

    from monokernel import LLM, SamplingParams
    llm = LLM()  # bundled SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(max_new_tokens=16)).text)
"""

from .model.config import ModelConfig
from .errors import (BackendUnavailableError, CheckpointError, ConfigError, GGUFError,
                     KernelError, MonokernelError, NumericalError, ProgramError, PromptError,
                     TensorMismatchError, TokenizerError, UnsupportedArchitectureError)
from .llm import LLM, Completion, Stream
from .sampling import SamplingParams

__all__ = [
    "LLM", "Completion", "Stream", "SamplingParams", "ModelConfig",
    "MonokernelError", "ConfigError", "UnsupportedArchitectureError", "CheckpointError",
    "TensorMismatchError", "GGUFError", "TokenizerError", "PromptError", "NumericalError",
    "ProgramError", "KernelError", "BackendUnavailableError",
]
__version__ = "0.1.0"
