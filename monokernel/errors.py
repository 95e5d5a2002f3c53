"""Every error monokernel raises on purpose derives from MonokernelError.

Messages name the thing that is wrong: the file, the tensor, the token or the instruction.
"""


class MonokernelError(Exception):
    """Base class of every error raised on purpose by monokernel."""


class ConfigError(MonokernelError):
    """config.json is missing a field, names an unknown architecture, or is inconsistent."""


class UnsupportedArchitectureError(ConfigError):
    """The checkpoint's architecture is not one monokernel runs."""


class CheckpointError(MonokernelError):
    """A weight file is missing, truncated or corrupt, or its tensors do not match the config."""


class TensorMismatchError(CheckpointError):
    """Tensors are missing, unexpected, or of the wrong shape; the message lists each by name."""


class GGUFError(CheckpointError):
    """A GGUF file is truncated, corrupt, or uses a type or tokenizer monokernel cannot import."""


class OutputExistsError(MonokernelError, FileExistsError):
    """The folder to write (``monokernel convert``) exists and is not empty; nothing was written."""


class OutputWriteError(MonokernelError, OSError):
    """A file monokernel writes (a converted model) could not be written: the disk is full or
    the folder is not writable. The message names the folder and the space needed; the
    partial output was removed."""


class TokenizerError(MonokernelError):
    """The tokenizer cannot be built or loaded."""


class PromptError(MonokernelError):
    """The prompt is empty, too long for the context, or holds a token id outside the vocabulary."""


class NumericalError(MonokernelError):
    """NaN or Inf appeared in the logits."""


class ProgramError(MonokernelError):
    """An instruction program failed verification; the message names the instructions."""


class KernelError(MonokernelError):
    """The kernel stopped with an error record (watchdog, bad opcode) or the host's wait expired."""


class BackendUnavailableError(MonokernelError):
    """The requested backend cannot run here (no CUDA device, no CuPy, no compiler)."""


class CostModelError(MonokernelError):
    """The cost model was asked about an unknown GPU or design, or a program it cannot run."""


class ParameterError(MonokernelError, ValueError):
    """A sampling or engine parameter has a bad type or value (NaN, Inf, out of range); the
    message names the parameter and the value. Also a ValueError, as Python code expects."""


class CacheError(MonokernelError):
    """The monokernel cache ($MONOKERNEL_CACHE) cannot be created or written."""
