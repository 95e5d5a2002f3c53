"""monokernel: a whole Llama-family decode step as one persistent CUDA megakernel.

    from monokernel import LLM, SamplingParams
    llm = LLM()  # bundled SmolLM2-135M-Instruct
    print(llm.generate("The capital of France is", SamplingParams(max_new_tokens=16)).text)
"""

from .model.config import ModelConfig
from .errors import (BackendUnavailableError, CacheError, CheckpointError, ConfigError,
                     GGUFError, KernelError, MonokernelError, NumericalError, OutputWriteError,
                     ParameterError, ProgramError, PromptError, TensorMismatchError,
                     TokenizerError, UnsupportedArchitectureError)
from .llm import LLM, Completion, CompletionOutput, Delta, Logprob, Stream, TokenLogprob
from .sampling import SamplingParams

__all__ = [
    "LLM", "Completion", "CompletionOutput", "Delta", "Stream", "TokenLogprob", "Logprob",
    "SamplingParams", "ModelConfig",
    "MonokernelError", "ConfigError", "UnsupportedArchitectureError", "CheckpointError",
    "TensorMismatchError", "GGUFError", "TokenizerError", "PromptError", "NumericalError",
    "ProgramError", "KernelError", "BackendUnavailableError", "ParameterError", "CacheError",
    "OutputWriteError",
]
try:  # one source of truth: pyproject.toml's version, as installed
    from importlib.metadata import PackageNotFoundError, version as _version

    __version__ = _version("monokernel")
except PackageNotFoundError:  # run from a source tree (PYTHONPATH) without installing
    __version__ = "0.1.0+source"
