"""Triton side of linear_cross_entropy; imported only when a candidate binds.

The tokens are walked in chunks of `ChunkPlan.chunk_rows` rows. Per chunk: the chunk's logits
hidden_chunk @ weight.T (+ bias) by torch's matmul into one reused (rows, V) buffer in the
inputs' dtype, then ONE Triton program per row that
  1. walks the vocabulary in blocks keeping a running max and sum of exponentials (online
     softmax), the sum of the logits (for label smoothing) and reads the target's logit, and
     writes the row's loss lse - (1 - eps) * logit[target] - eps / V * sum(logits) in fp32
     (0 for an ignored row; NaN for a target outside [0, V), which `check_targets` has already
     refused or queued a device assert for);
  2. when gradients are wanted, walks the blocks again and overwrites the logits in place with
     scale * (softmax - (1 - eps) * onehot(target) - eps / V): d loss / d logits, where scale
     is 1 / (tokens not ignored) for "mean", 1 for "sum", grad_output[row] for the backward of
     "none", and 0 for an ignored row.
Then grad_hidden_chunk = grad_logits @ weight (written straight into its rows of grad_hidden),
grad_weight += grad_logits.T @ hidden_chunk and grad_bias += column sums of grad_logits. The
weight and bias gradients accumulate in fp32, one matmul per chunk with an fp32 output, and are
rounded once at the end (accumulating in bf16 instead, a rounding per chunk, gives 3.6x eager's
error at 9 chunks against fp64, beyond the 3x rule; many accumulator slabs slowed the
weight-gradient matmul by 28% at 1280 rows on an H100). With few tokens per hidden unit
(`SPLIT_TOKENS_PER_HIDDEN`) the fp32 weight gradient is held as two slabs, the vocabulary's
halves, so its bf16/fp16 rounding can be written into the first slab's own memory
(`_SplitAccumulator`): the rounded copy (V * H elements) never coexists with the fp32 one. It
would otherwise set the peak, and at a quarter of the full logits (T * V) or more it would take
the peak past a quarter of eager's. Two half matmuls cost 12-28% more than one at 1664-2048 rows
on an H100 (`benchmarks/sweep_lce_accumulator.py`), so larger batches keep one accumulator. The
count of tokens not ignored stays on the device (no host sync anywhere).

The row kernel's block and warps come from `RowLaunch.elementwise` (SIMD width, element size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchhal.hal_core import telemetry
from torchhal.kernels import triton_attention_interpreter
from torchhal.kernels.linear_cross_entropy import (
    BACKWARD,
    OP,
    ChunkPlan,
    check_targets,
    has_bias,
    scale_gradients,
)
from torchhal.kernels.triton_rows import compute_dtype

log = telemetry.get_logger("torchhal.kernels.cross_entropy")

if triton_attention_interpreter.needs_fix():  # `for` over the vocabulary in the CPU interpreter
    triton_attention_interpreter.apply()


@triton.jit
def _cross_entropy_rows(
    LOGITS, logits_stride, TARGET, LOSS, SCALE, scale_stride, n_cols, ignore_index, smoothing,
    WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * logits_stride
    target = tl.load(TARGET + row).to(tl.int64)
    kept = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    m = float("-inf")
    d = 0.0
    total = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # while every logit so far is -inf (a masked vocabulary block), shift by 0: exp(-inf - -inf) is NaN
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        total += tl.sum(tl.where(mask, x, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(d)
    x_target = tl.load(base + tl.where(in_range, target, 0)).to(tl.float32)
    uniform = smoothing / n_cols
    # without smoothing the sum of logits has no weight, and a -inf logit must not make 0 * -inf
    smoothed = tl.where(smoothing == 0.0, 0.0, uniform * total)
    loss = lse - (1.0 - smoothing) * x_target - smoothed
    loss = tl.where(kept, tl.where(in_range, loss, float("nan")), 0.0)
    tl.store(LOSS + row, loss)
    if WRITE_GRAD:
        scale = tl.load(SCALE + row * scale_stride).to(tl.float32)
        scale = tl.where(kept, tl.where(in_range, scale, float("nan")), 0.0)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            # exp(x - m) / d, not exp(x - lse): the lse carries its rounding at the logits' scale
            # into every probability (4.5x PyTorch's error where softmax - 1/V cancels, vocab 2)
            grad = tl.exp(x - m) / d - uniform - tl.where(cols == target, 1.0 - smoothing, 0.0)
            tl.store(base + cols, (grad * scale).to(LOGITS.dtype.element_ty), mask=mask)


_MIXED_ADDMM: dict[str, bool] = {}  # torch device type -> has addmm with bf16/fp16 inputs, fp32 out
FALLBACK_SLICE_ELEMENTS = 1 << 24  # the fallback's rounded product, a slice at a time (32 MiB in bf16)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc in fp32: one matmul with an fp32 output where torch has one for the
    device (addmm's out_dtype), else products rounded to a's dtype and added, a slice of acc's
    rows at a time so the temporary stays small."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    kind = acc.device.type
    if _MIXED_ADDMM.get(kind, True):
        try:
            torch.addmm(acc, a, b, acc.dtype, out=acc)
            _MIXED_ADDMM[kind] = True
            return
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, NotImplementedError) as exc:  # torch < 2.8, or no such kernel
            _MIXED_ADDMM[kind] = False
            log.warning(
                "no fp32-output addmm for this device type: weight-gradient products are rounded to "
                "the inputs' dtype before the fp32 accumulation (counted per chunk)",
                device_type=kind,
                error=repr(exc),
            )
    telemetry.count("torchhal.kernels.lce_rounded_products", device_type=kind)
    step = max(1, FALLBACK_SLICE_ELEMENTS // max(1, acc.shape[1]))
    for start in range(0, acc.shape[0], step):
        acc[start : start + step].add_(torch.mm(a[start : start + step], b))


ROUNDING_SLICES = 16  # in-place rounding goes a slab's 1/16 at a time; the first slice via a copy
SLAB_ALIGN_ROWS = 8  # the second slab's matmul operand starts 16-byte aligned in a 2-byte dtype
SPLIT_TOKENS_PER_HIDDEN = 4  # at most this many tokens per hidden unit: the weight gradient splits


class _SplitAccumulator:
    """The fp32 weight gradient (V, W), split: as two slabs of vocabulary rows. Rounded to a 2-byte
    dtype, each slab's values fit in the first half of its own memory, and the second slab's then
    fit in the first slab's second half, so the rounded gradient is the first slab's memory,
    reused. Not split (or for an fp32/fp64 weight): one slab, rounded by `.to()`."""

    def __init__(
        self, vocab: int, width: int, dtype: torch.dtype, device: torch.device, *, split: bool = True
    ) -> None:
        self.dtype = dtype
        acc_dtype = torch.promote_types(dtype, torch.float32)
        self.in_place = split and acc_dtype.itemsize == 2 * dtype.itemsize
        half = SLAB_ALIGN_ROWS * -(-((vocab + 1) // 2) // SLAB_ALIGN_ROWS)  # >= the second slab's rows
        first_rows = min(vocab, half) if self.in_place else vocab
        self.slabs = tuple(
            torch.zeros((rows, width), dtype=acc_dtype, device=device)
            for rows in (first_rows, vocab - first_rows)
        )

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """+= a @ b for a (V, rows), b (rows, W)."""
        for slab, part in zip(self.slabs, torch.split(a, self.slabs[0].shape[0]), strict=False):
            _accumulate(slab, part, b)

    def rounded(self) -> torch.Tensor:
        first, second = self.slabs
        if not self.in_place:
            return first.to(self.dtype)
        width = first.shape[1]
        memory = first.view(-1).view(self.dtype)
        _round_into(first, memory)
        if second.numel():
            second_rounded = second.view(-1).view(self.dtype)
            _round_into(second, second_rounded)
            memory[first.numel() : first.numel() + second.numel()].copy_(second_rounded[: second.numel()])
        self.slabs = ()
        vocab = first.shape[0] + second.shape[0]
        return memory[: vocab * width].view(vocab, width)


def _round_into(slab: torch.Tensor, memory: torch.Tensor) -> None:
    """Write `slab`'s rows, rounded, to the front of `memory` (a view of slab's own storage in the
    2-byte dtype). Rows [s, e) land on the bytes of fp32 rows [s/2, e/2): for every slice but the
    first those rows were already read, so the copy never reads what it overwrote."""
    rows, width = slab.shape
    step = -(-rows // ROUNDING_SLICES)
    for start in range(0, rows, step):
        end = min(rows, start + step)
        values = slab[start:end]
        if start == 0:
            values = values.to(memory.dtype)  # overlaps its own target: round into a temporary first
        memory[start * width : end * width].view(end - start, width).copy_(values)


def _flat(
    hidden: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    b = bias if has_bias(bias) else None
    return hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1).contiguous(), b


def _chunked(
    plan: ChunkPlan,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None]:
    """Per-token fp32 losses of hidden (N, H), target (N,), and with `scale` (one fp32 element, or
    N: one per token) the gradients of sum(scale * loss): (grad_hidden, grad_weight in weight's
    dtype, fp32 grad_bias or None)."""
    tokens, width = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    losses = torch.empty(tokens, dtype=torch.float32, device=device)
    grads = None
    if scale is not None:
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        split = tokens <= SPLIT_TOKENS_PER_HIDDEN * width
        grads = (
            torch.empty((tokens, width), dtype=hidden.dtype, device=device),
            _SplitAccumulator(vocab, width, weight.dtype, device, split=split),
            torch.zeros(vocab, dtype=acc_dtype, device=device) if bias is not None else None,
        )
    rows = plan.chunk_rows(tokens, width, vocab)
    logits = torch.empty((rows, vocab), dtype=hidden.dtype, device=device)
    chunk = logits[:0]  # bound even when there are no tokens, for the `del` below
    block, warps = plan.launch.elementwise(vocab, logits.element_size())
    if scale is None:
        scale = torch.ones(1, dtype=torch.float32, device=device)
    for start in range(0, tokens, rows):
        end = min(start + rows, tokens)
        h = hidden[start:end]
        chunk = logits[: end - start]
        if bias is None:
            torch.mm(h, weight.t(), out=chunk)
        else:
            torch.addmm(bias, h, weight.t(), out=chunk)
        row_scale, scale_stride = (scale, 0) if scale.numel() == 1 else (scale[start:end], 1)
        _cross_entropy_rows[(end - start,)](
            chunk, chunk.stride(0), target[start:end], losses[start:end], row_scale, scale_stride,
            vocab, ignore_index, float(label_smoothing),
            WRITE_GRAD=grads is not None, BLOCK=block, num_warps=warps,
        )  # fmt: skip
        if grads is not None:
            grad_hidden, grad_weight, grad_bias = grads
            torch.mm(chunk, weight, out=grad_hidden[start:end])
            grad_weight.add(chunk.t(), h)
            if grad_bias is not None:
                grad_bias += chunk.sum(0, dtype=grad_bias.dtype)
    # the chunk's logits go before the weight gradient is rounded: alive, they sat beside the
    # accumulator and its rounded copy, the op's peak (16k tokens, vocab 128k: 1.99 GiB, not 1.5)
    del logits, chunk
    if grads is None:
        return losses, None
    grad_hidden, grad_weight, grad_bias = grads
    return losses, (grad_hidden, grad_weight.rounded(), grad_bias)


def _reduce(
    losses: torch.Tensor,
    target: torch.Tensor,
    n_valid: torch.Tensor | None,
    reduction: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    if reduction == "none":
        return losses.reshape(target.shape).to(dtype)
    total = losses.sum()
    return (total if n_valid is None else total / n_valid).to(dtype)


def _n_valid(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Tokens not ignored over the whole batch, as an fp32 device scalar (0 makes "mean" NaN)."""
    return (target != ignore_index).sum().to(torch.float32)


def linear_cross_entropy(
    plan: ChunkPlan,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """The loss alone: the row kernel writes no gradients."""
    check_targets(OP, target, weight.shape[0], ignore_index)
    h, t, b = _flat(hidden, target, bias)
    losses, _ = _chunked(plan, h, weight, t, b, ignore_index, label_smoothing, None)
    n_valid = _n_valid(t, ignore_index) if reduction == "mean" else None
    return _reduce(losses, target, n_valid, reduction, compute_dtype(hidden.dtype))


def _rounded(
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    hidden: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_hidden, grad_weight, grad_bias = grads
    if grad_bias is None or bias is None:
        rounded_bias = hidden.new_empty(0)
    else:
        rounded_bias = grad_bias.to(bias.dtype)
    return grad_hidden.reshape(hidden.shape), grad_weight, rounded_bias


def linear_cross_entropy_forward(
    plan: ChunkPlan,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, grad_hidden, grad_weight, grad_bias) of the loss itself; for "none" the loss and
    three empty tensors (its backward recomputes)."""
    if reduction == "none":
        loss = linear_cross_entropy(
            plan, hidden, weight, target, bias, ignore_index, label_smoothing, reduction
        )
        return loss, hidden.new_empty(0), hidden.new_empty(0), hidden.new_empty(0)
    check_targets(OP, target, weight.shape[0], ignore_index)  # the name the reference gives too
    h, t, b = _flat(hidden, target, bias)
    n_valid = _n_valid(t, ignore_index) if reduction == "mean" else None
    scale = (1.0 / n_valid).reshape(1) if n_valid is not None else torch.ones(1, device=hidden.device)
    losses, grads = _chunked(plan, h, weight, t, b, ignore_index, label_smoothing, scale)
    assert grads is not None
    loss = _reduce(losses, target, n_valid, reduction, compute_dtype(hidden.dtype))
    return (loss, *_rounded(grads, hidden, b))


def linear_cross_entropy_backward(
    plan: ChunkPlan,
    grad_loss: torch.Tensor,
    grad_hidden: torch.Tensor,
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor,
    hidden: torch.Tensor | None,
    weight: torch.Tensor | None,
    target: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ "mean", "sum": the forward's gradients times grad_loss. "none": recomputed chunk by chunk
    with each token's row of d loss / d logits scaled by its grad_loss."""
    if reduction != "none":
        return scale_gradients(grad_loss, (grad_hidden, grad_weight, grad_bias))
    assert hidden is not None and weight is not None and target is not None
    check_targets(BACKWARD, target, weight.shape[0], ignore_index)
    h, t, b = _flat(hidden, target, bias)
    scale = grad_loss.reshape(-1).to(torch.float32).contiguous()
    _, grads = _chunked(plan, h, weight, t, b, ignore_index, label_smoothing, scale)
    assert grads is not None
    return _rounded(grads, hidden, b)
