"""`torchhal.ops` captured in CUDA graphs after a warm-up, as vLLM captures its decoding steps,
`torch.cuda.make_graphed_callables` a training block and torch.compile's "reduce-overhead" mode
whatever it compiles. Replayed on new inputs copied into the captured tensors, each op gives what
it gives when called eagerly. A dispatch or a kernel that synchronised, read a tensor's values on
the host or kept the capture's inputs would fail the capture or give the first inputs' results."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchhal
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core.settings import Settings
from torchhal.kernels import nn as thnn

pytestmark = pytest.mark.gpu

Inputs = Callable[[], tuple[torch.Tensor, ...]]
REPLAYS = 3


@pytest.fixture(scope="module", autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _cuda_randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)


VARLEN = [37, 128, 1, 90]

CASES: dict[str, tuple[Callable[..., object], Inputs]] = {
    "rms_norm": (
        lambda x, w: torchhal.ops.rms_norm(x, w),
        lambda: (_cuda_randn(64, 4096), _cuda_randn(4096)),
    ),
    "layer_norm": (
        lambda x, w, b: torchhal.ops.layer_norm(x, w, b),
        lambda: (_cuda_randn(64, 2048), _cuda_randn(2048), _cuda_randn(2048)),
    ),
    "swiglu": (
        lambda g, u: torchhal.ops.swiglu(g, u),
        lambda: (_cuda_randn(64, 8192), _cuda_randn(64, 8192)),
    ),
    "geglu": (
        lambda g, u: torchhal.ops.geglu(g, u),
        lambda: (_cuda_randn(64, 8192), _cuda_randn(64, 8192)),
    ),
    "rope": (
        lambda q, k, cos, sin: torchhal.ops.rope(q, k, cos, sin),
        lambda: (
            _cuda_randn(4, 32, 16, 128),
            _cuda_randn(4, 8, 16, 128),
            _cuda_randn(4, 1, 16, 128),
            _cuda_randn(4, 1, 16, 128),
        ),
    ),
    "attention, decoding with GQA": (  # one new query against a 1000-key cache, bottom-right causal
        lambda q, k, v: torchhal.ops.attention(q, k, v, causal=True),
        lambda: (_cuda_randn(8, 32, 1, 128), _cuda_randn(8, 8, 1000, 128), _cuda_randn(8, 8, 1000, 128)),
    ),
    "attention, prefill with a window": (
        lambda q, k, v: torchhal.ops.attention(q, k, v, causal=True, window=(255, 0)),
        lambda: (_cuda_randn(2, 16, 777, 64), _cuda_randn(2, 16, 777, 64), _cuda_randn(2, 16, 777, 64)),
    ),
    "attention_varlen": (
        lambda q, k, v, cu: torchhal.ops.attention_varlen(
            q, k, v, cu, cu, max(VARLEN), max(VARLEN), causal=True
        ),
        lambda: (
            _cuda_randn(sum(VARLEN), 16, 128),
            _cuda_randn(sum(VARLEN), 4, 128),
            _cuda_randn(sum(VARLEN), 4, 128),
            _offsets(VARLEN),
        ),
    ),
    "linear_cross_entropy": (  # targets checked on the device (an asynchronous assert), not the host
        lambda h, w, t: torchhal.ops.linear_cross_entropy(h, w, t),
        lambda: (
            _cuda_randn(256, 1024),
            _cuda_randn(32000, 1024),
            torch.randint(0, 32000, (256,), device="cuda").masked_fill_(
                torch.rand(256, device="cuda") < 0.1, -100
            ),
        ),
    ),
}


def _as_tuple(out: object) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)  # type: ignore[return-value]


def _warm_up(run: Callable[[], object]) -> None:
    """Selection (measured on the first call), Triton's compilation and autotuning, on a side
    stream as torch's capture documentation asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)


@pytest.mark.parametrize("case", list(CASES))
def test_an_op_captured_in_a_cuda_graph_replays_on_new_inputs(case):
    op, make_inputs = CASES[case]
    static = make_inputs()
    _warm_up(lambda: op(*static))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _as_tuple(op(*static))
    for _ in range(REPLAYS):
        fresh = make_inputs()
        for into, value in zip(static, fresh, strict=True):
            into.copy_(value)
        graph.replay()
        for got, want in zip(captured, _as_tuple(op(*fresh)), strict=True):
            torch.testing.assert_close(got, want)  # the first inputs' results would be far off


def assert_near(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    """Relative error in norm: bf16 results of the same math in another order (the attention
    backward's dq accumulation) differ by a few roundings; a stale or wrong result by ~1."""
    got, want = got.detach().float(), want.detach().float()
    error = float((got - want).norm() / want.norm().clamp_min(1e-30))
    assert error <= tolerance, f"relative error {error:.3g} > {tolerance}"


class Block(nn.Module):
    """A pre-norm Llama block made of torchhal's drop-in modules."""

    def __init__(self, hidden: int = 1024, heads: int = 16, kv_heads: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2 = thnn.RMSNorm(hidden), thnn.RMSNorm(hidden)
        self.attention = thnn.Attention(hidden, heads, kv_heads)
        self.mlp = thnn.SwiGLUMLP(hidden, 4 * hidden)
        self.rotary = thnn.RotaryEmbedding(hidden // heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        h = x + self.attention(self.norm1(x), self.rotary(x, positions))[0]
        return h + self.mlp(self.norm2(h))


def _block() -> Block:
    torch.manual_seed(0)
    return Block().to("cuda", torch.bfloat16)


def _triton_only() -> HardwareAbstractionLayer:
    """A HAL whose candidates are torchhal's Triton kernels and the references, every other
    candidate (the NVIDIA plugin's SDPA flash and cuDNN, ATen's) disabled: measured selection
    picks those on an H100 for this block's attention, so the default HAL would not capture
    torchhal's Triton attention."""
    everything = HardwareAbstractionLayer()
    others = {
        c.qualified_name
        for op in everything.kernels.ops()
        for c in everything.kernels.candidates(op)
        if c.qualified_name not in ("torchhal/triton", "torchhal/reference")
    }
    return HardwareAbstractionLayer(settings=Settings(disable_kernels=tuple(sorted(others))))


@pytest.mark.parametrize("kernels", ["selected", "triton"])
def test_a_training_block_graphed_forward_and_backward_matches_eager(kernels):
    """make_graphed_callables captures the block's forward and its backward; output and
    gradients of inputs and parameters match an eager copy. `selected`: the default HAL's
    measured choices; `triton`: torchhal's Triton kernels, forward and backward, checked to be
    the ones that ran."""
    hal = _triton_only() if kernels == "triton" else torchhal.ops.default_hal()
    with hal.use(hal.device_for_tensor(torch.empty(0, device="cuda"))):
        graphed, eager = _block(), _block()
        sample = _cuda_randn(2, 512, 1024).requires_grad_()
        graphed = torch.cuda.make_graphed_callables(graphed, (sample,))
        for _ in range(REPLAYS):
            x = _cuda_randn(2, 512, 1024)
            grad_out = _cuda_randn(2, 512, 1024)
            results = []
            for block in (graphed, eager):
                xi = x.clone().requires_grad_()
                out = block(xi)
                grads = torch.autograd.grad(out, (xi, *block.parameters()), grad_out)
                results.append((out, grads))
            (out_g, grads_g), (out_e, grads_e) = results
            for got, want in zip((out_g, *grads_g), (out_e, *grads_e), strict=True):
                assert_near(got, want, 1e-2)
    if kernels == "triton":
        ran = {
            op: {s.candidate.qualified_name for s in by.values()}
            for op, by in hal.kernels._cache.items()
            if by
        }
        assert {"attention_forward", "attention_backward", "rms_norm_backward"} <= set(ran), ran
        assert all(names == {"torchhal/triton"} for names in ran.values()), ran
        assert dict(hal.kernels.fallback_counts) == {}


def test_reduce_overhead_compile_of_a_decoder_block_matches_eager():
    """torch.compile's "reduce-overhead" mode records the compiled block in CUDA graphs (cudagraph
    trees) with torchhal's custom ops inside."""
    torch._dynamo.reset()
    block = _block().eval()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(REPLAYS + 2):  # the first calls record; the later ones replay
            x = _cuda_randn(4, 256, 1024)
            got = compiled(x).clone()
            assert_near(got, block(x), 2e-2)  # inductor fuses the rest in its own order
