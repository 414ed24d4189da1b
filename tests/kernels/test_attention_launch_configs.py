"""Launch configurations of the Triton attention kernels for devices of every SIMD width."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from torchhal.kernels.triton_attention_config import SHARED_MEMORY_HEADROOM, launch_configs


@pytest.mark.parametrize("simd_width", [16, 32, 64])
@pytest.mark.parametrize("shared_memory", [49152, 101376, 232448])
@pytest.mark.parametrize("element_bytes", [2, 4])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
def test_warps_are_powers_of_two_and_dq_fits_shared_memory(
    simd_width, shared_memory, element_bytes, head_dim
):
    """Triton refuses a warp count that is not a power of 2; the dq kernel's resident q and dO
    tiles and one stage of k and v stay within the budget the module derives."""
    caps = SimpleNamespace(
        shared_memory_per_block_bytes=shared_memory, simd_width=simd_width, compute_units=8
    )
    configs = launch_configs(caps, head_dim, element_bytes)
    for tile in (configs.forward, configs.forward_narrow, configs.backward_dq, configs.backward_dkdv):
        assert tile.num_warps >= 1 and tile.num_warps & (tile.num_warps - 1) == 0, tile
        assert tile.num_stages >= 1, tile
    dq = configs.backward_dq
    used = 2 * dq.block_m * head_dim * element_bytes + 2 * dq.block_n * head_dim * element_bytes
    assert used <= shared_memory * SHARED_MEMORY_HEADROOM or dq.block_n == 16, dq


def test_dkdv_lanes_follow_the_simd_width():
    """The 16-bit dk/dv kernel keeps 128 lanes whatever the warp width (four 32-wide warps, two 64-wide)."""
    for simd_width, warps in ((32, 4), (64, 2), (16, 8)):
        caps = SimpleNamespace(shared_memory_per_block_bytes=232448, simd_width=simd_width, compute_units=8)
        assert launch_configs(caps, 128, 2).backward_dkdv.num_warps == warps
