"""Experiment: the norm backwards with half the programs (RESIDENT_THREADS_PER_UNIT 512 instead of 1024)."""

import dataclasses

from torchhal.kernels import triton_norms as _tn
from torchhal.kernels.triton_rows import MIN_ROWS_PER_PROGRAM, RowLaunch


@dataclasses.dataclass(frozen=True)
class _Half(RowLaunch):
    def backward_programs(self, rows, warps):
        per_unit = max(1, 512 // (warps * self.simd_width))
        busy = self.compute_units * per_unit
        return max(1, min(rows, busy, max(self.compute_units, rows // MIN_ROWS_PER_PROGRAM)))


def _half(launch):
    return _Half(launch.simd_width, launch.compute_units)


def rms_norm_backward(launch, *args, **kwargs):
    return _tn.rms_norm_backward(_half(launch), *args, **kwargs)


def layer_norm_backward(launch, *args, **kwargs):
    return _tn.layer_norm_backward(_half(launch), *args, **kwargs)
