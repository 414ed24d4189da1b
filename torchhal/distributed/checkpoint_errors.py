"""The checkpoint errors, apart from `checkpoint` so that its optimizer load target
(`optimizer_load`) raises them without importing the checkpointer."""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

from torchhal.hal_core import TorchHALError


class CheckpointError(TorchHALError, RuntimeError):
    """A checkpoint is missing, incomplete or corrupt, or cannot be applied to the model."""


class CheckpointIOError(CheckpointError, OSError):
    """A CheckpointError whose cause was an OSError (a full disk during the commit's rename), on
    every rank: `except OSError` catches it as it caught the cause where it happened."""


def error_line(exc: BaseException) -> str:
    """One line for an error: DCP's CheckpointException as the ranks that failed and their errors."""
    if isinstance(exc, CheckpointException):
        errors = "; ".join(
            f"rank {rank}: {error_line(failure[0])}" for rank, failure in sorted(exc.failures.items())
        )
        return errors or "DCP reported no rank's error"
    return f"{type(exc).__name__}: {exc}".splitlines()[0]
