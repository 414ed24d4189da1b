"""train() in a world of one rank: the model's strategy, FSDP2's input casts, modes after on_step,
gradients held before train, and token counts of mapping and floating batches."""

from __future__ import annotations

import copy
import io
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchhal import distributed as thd
from torchhal.hal_core import InvalidArgumentError, telemetry

DIM = 5


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


class Regression(nn.Module):
    """Blocks in `layers` (FSDP2 shards them apart), a BatchNorm, a Dropout, and the loss in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2))
        self.norm = nn.BatchNorm1d(DIM)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(self.head(self.drop(self.norm(x))).squeeze(-1).float(), y)


def regression_batches(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(rows, DIM), torch.randn(rows)) for _ in range(steps)]


def counted(name: str) -> int:
    return sum(v for k, v in telemetry.counts().items() if k == name or k.startswith(name + ","))


def logs() -> io.StringIO:
    stream = io.StringIO()
    telemetry.configure(log_level="info", log_stream=stream)
    return stream


def seeded(seed: int):
    torch.manual_seed(seed)
    return Regression()


# -- the strategy comes from the model -----------------------------------------------------------


def test_the_policy_given_to_prepare_trains_an_fsdp_model_as_prepared_policy_does(ctx):
    """choose_precision's bf16 policy has no strategy: under FSDP2 train added autocast to FSDP2's
    own casting, so the same model and batches trained to other parameters than with
    prepared.policy. The strategy comes from the model now: no autocast, identical parameters."""
    seed, steps = random.randrange(2**31), 3
    data = regression_batches(steps, 6)
    policy = thd.choose_precision(ctx.device, prefer="bf16")
    results = []
    for which in ("given", "prepared"):
        prepared = thd.prepare(seeded(seed), sgd, ctx=ctx, strategy="fsdp", policy=policy)
        autocast = []

        def loss_fn(model, batch, autocast=autocast):
            autocast.append(torch.is_autocast_enabled("cpu"))
            return model(*batch)

        torch.manual_seed(seed)  # the dropout masks
        thd.train(
            prepared.model, prepared.optimizer, data, steps=steps, ctx=ctx,
            policy=policy if which == "given" else prepared.policy, loss_fn=loss_fn,
        )  # fmt: skip
        assert autocast == [False] * steps, (which, autocast)
        results.append([p.detach().full_tensor().clone() for p in prepared.model.parameters()])
    given, reference = results
    assert all(torch.equal(a, b) for a, b in zip(given, reference, strict=True))


def test_a_policy_prepared_for_another_strategy_than_the_models_is_refused(ctx):
    """prepared.policy of a DDP model with the module inside it (gradients never synchronised), and
    a `local` policy with a DDP model: each refused before anything runs, naming both strategies."""
    seed = random.randrange(2**31)
    ddp = thd.prepare(seeded(seed), sgd, ctx=ctx, strategy="ddp")
    local = thd.prepare(seeded(seed), sgd, ctx=ctx, strategy="local")
    before = [p.detach().clone() for p in ddp.model.parameters()]
    cases = [
        (ddp.model.module, ddp.policy, r"strategy 'ddp', but the model holds no DistributedDataParallel"),
        (ddp.model, local.policy, r"strategy 'local', but the model holds a DistributedDataParallel module"),
    ]
    for model, policy, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            thd.train(model, ddp.optimizer, regression_batches(1, 4), steps=1, ctx=ctx, policy=policy)
    assert all(torch.equal(b, p) for b, p in zip(before, ddp.model.parameters(), strict=True))


# -- FSDP2 casts the model's floating inputs ------------------------------------------------------


def test_fsdp_casting_the_models_floating_inputs_is_said_once_a_call(ctx):
    """FSDP2 (bf16) casts the fp32 targets passed to model(*batch) to bf16, where DDP's autocast
    keeps them: the forward sees bf16-rounded targets. Each train call that casts warns once,
    naming the tensors, and counts once; fp32 parameters and integer inputs cast nothing."""
    rows = random.randint(3, 8)
    seen = []

    class Seeing(Regression):
        def forward(self, x, y):
            seen.append(y.clone())
            return super().forward(x, y)

    data = regression_batches(2, rows)
    key = "torchhal.train.fsdp_cast_inputs"
    stream = logs()
    for prefer, expect in (("fp32", 0), ("bf16", 2)):
        policy = thd.choose_precision(ctx.device, prefer=prefer)
        prepared = thd.prepare(Seeing(), sgd, ctx=ctx, strategy="fsdp", policy=policy)
        before, seen[:] = counted(key), []
        for _ in range(2):  # two calls of two steps
            thd.train(prepared.model, prepared.optimizer, data, steps=2, ctx=ctx, policy=prepared.policy)
        assert counted(key) - before == expect, prefer
        want = [y.to(policy.compute_dtype) for _, y in data] * 2
        assert all(torch.equal(s, w) for s, w in zip(seen, want, strict=True))
    said = [line for line in stream.getvalue().splitlines() if "FSDP2 cast floating-point inputs" in line]
    assert len(said) == 2, said
    assert f"({rows}, {DIM}) float32->bfloat16" in said[0] and f"({rows},) float32->bfloat16" in said[0]

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Embedding(11, DIM)])
            self.head = nn.Linear(DIM, 11)

        def forward(self, ids, labels):
            return F.cross_entropy(self.head(self.layers[0](ids)).float().flatten(0, 1), labels.flatten())

    prepared = thd.prepare(
        Tokens(), sgd, ctx=ctx, strategy="fsdp", policy=thd.choose_precision(ctx.device, prefer="bf16")
    )
    ids = [(torch.randint(0, 11, (2, rows)), torch.randint(0, 11, (2, rows)))]
    before = counted(key)
    thd.train(prepared.model, prepared.optimizer, ids, steps=1, ctx=ctx, policy=prepared.policy)
    assert counted(key) == before


# -- modes after on_step ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["local", "ddp"])
def test_a_validation_pass_in_on_step_leaves_later_steps_training(ctx, strategy):
    """on_step puts the model (under DDP: the caller's own model, inside the wrapper) in evaluation
    mode for a validation pass. Every later step trained in evaluation mode (no dropout, BatchNorm
    on its running statistics): the parameters and statistics differed from a run without
    validation. The recorded modes are put back, the BatchNorm frozen before train kept frozen."""
    seed, steps = random.randrange(2**31), 3
    data = regression_batches(steps, 6)
    key = "torchhal.train.modes_put_back"
    held_out = (torch.randn(4, DIM), torch.randn(4))  # made here: the validation draws no random numbers
    results = []
    for validate in (True, False):
        model = seeded(seed)
        model.layers[1].eval()  # frozen by its author: stays so
        prepared = thd.prepare(model, sgd, ctx=ctx, strategy=strategy)
        modes = []

        def loss_fn(m, batch, modes=modes, model=model):
            modes.append([module.training for module in model.modules()])
            return m(*batch)

        def on_step(stats, model=model, validate=validate):
            if validate:
                model.eval()
                with torch.no_grad():
                    model(*held_out)

        torch.manual_seed(seed)  # the dropout masks
        before = counted(key)
        thd.train(
            prepared.model, prepared.optimizer, data, steps=steps, ctx=ctx, policy=prepared.policy,
            loss_fn=loss_fn, on_step=on_step,
        )  # fmt: skip
        assert counted(key) - before == (steps if validate else 0)
        assert modes == [modes[0]] * steps and modes[0].count(False) == 3  # layers[1], its Linear, its Tanh
        results.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    validated, plain = results
    for name, value in plain.items():
        assert torch.equal(validated[name], value), name


# -- gradients held before train ---------------------------------------------------------------------


def test_gradients_held_when_train_begins_are_dropped_and_said(ctx):
    """A probe's backward before train (on part of the model) left gradients that were added into
    the first step's. They are dropped: the first step equals a run without the probe, and the
    warning names how many parameters held one."""
    seed = random.randrange(2**31)
    data = regression_batches(2, 6)
    stream = logs()
    key = "torchhal.train.stale_gradients_dropped"
    results = []
    for probe in (True, False):
        prepared = thd.prepare(seeded(seed), sgd, ctx=ctx, strategy="local")
        if probe:
            x = torch.randn(6, DIM) * 10
            prepared.model.head(prepared.model.layers[0](x)).sum().backward()  # 4 of the 8 parameters
        before = counted(key)
        torch.manual_seed(seed)
        thd.train(prepared.model, prepared.optimizer, data, steps=2, ctx=ctx, policy=prepared.policy)
        assert counted(key) - before == (4 if probe else 0)
        results.append([p.detach().clone() for p in prepared.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    said = [line for line in stream.getvalue().splitlines() if "held gradients when train began" in line]
    assert len(said) == 1 and "parameters_with_gradients=4" in said[0] and "warning" in said[0], said


# -- token counts ------------------------------------------------------------------------------------


class Embedded(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.head = nn.Linear(DIM, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def lm_loss(model, batch) -> torch.Tensor:
    ids = batch["input_ids"] if "input_ids" in batch else batch["labels"]
    return F.cross_entropy(model(ids).flatten(0, 1), batch["labels"].flatten())


def test_a_mapping_batch_counts_its_input_ids_and_has_its_tensors_checked(ctx):
    """A Hugging Face batch counted 0 tokens (tokens_per_s 0.0) and its tensors' device went
    unchecked. Tokens come from input_ids, else labels; every value is on the rank's device."""
    vocab, b, t = 13, random.randint(2, 5), random.randint(3, 9)
    prepared = thd.prepare(Embedded(vocab), sgd, ctx=ctx, strategy="local")

    def hf(with_ids: bool, mask_device: str = "cpu") -> dict[str, torch.Tensor]:
        batch = {
            "labels": torch.randint(0, vocab, (b, t)),
            "attention_mask": torch.ones(b, t, device=mask_device),
        }
        if with_ids:
            batch["input_ids"] = torch.randint(0, vocab, (b, t))
        return batch

    for with_ids in (True, False):
        stats = thd.train(
            prepared.model, prepared.optimizer, [hf(with_ids), hf(with_ids)], steps=2, ctx=ctx,
            policy=prepared.policy, loss_fn=lm_loss,
        )  # fmt: skip
        assert [s.tokens for s in stats] == [b * t] * 2
        assert all(s.tokens_per_s == pytest.approx(b * t / s.step_time_s) for s in stats)
    with pytest.raises(InvalidArgumentError, match=r"a batch tensor is on meta, but rank 0 trains on cpu"):
        thd.train(
            prepared.model, prepared.optimizer, [hf(True, "meta")], steps=1, ctx=ctx,
            policy=prepared.policy, loss_fn=lm_loss,
        )  # fmt: skip


def test_a_floating_first_tensor_counts_its_rows_not_its_features(ctx):
    """A (B, T, D) embedding batch counted B*T*D tokens; it counts B*T, a (B, D) one B, and a
    mapping without input_ids or labels its first tensor value alike."""
    b, t = random.randint(2, 5), random.randint(2, 6)
    model = nn.Linear(DIM, 1)
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy="local")
    loss = lambda m, batch: m(batch[0] if isinstance(batch, tuple) else batch["x"]).pow(2).mean()  # noqa: E731
    for batch, want in (
        ((torch.randn(b, t, DIM), torch.randn(b, t)), b * t),
        ((torch.randn(b, DIM),), b),
        ({"x": torch.randn(b, t, DIM)}, b * t),
    ):
        (stats,) = thd.train(
            prepared.model,
            prepared.optimizer,
            [batch],
            steps=1,
            ctx=ctx,
            policy=prepared.policy,
            loss_fn=loss,
        )
        assert stats.tokens == want


@dataclass
class Sample:
    x: torch.Tensor
    y: torch.Tensor


def test_a_batch_without_tensors_to_count_reports_no_tokens_and_says_so_once(ctx):
    """A batch object holding its tensors in fields counted 0 tokens, a false rate. Its tokens and
    rate are None now, said once a train call (a warning, counted once)."""
    model = nn.Linear(DIM, 1)
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy="local")
    data = [Sample(torch.randn(4, DIM), torch.randn(4)) for _ in range(3)]
    stream = logs()
    key = "torchhal.train.tokens_uncounted"
    before = counted(key)
    stats = thd.train(
        prepared.model, prepared.optimizer, data, steps=3, ctx=ctx, policy=prepared.policy,
        loss_fn=lambda m, s: F.mse_loss(m(s.x).squeeze(-1), s.y),
    )  # fmt: skip
    assert [(s.tokens, s.tokens_per_s) for s in stats] == [(None, None)] * 3
    assert all(s.loss > 0 for s in stats)
    assert counted(key) - before == 1
    assert len([line for line in stream.getvalue().splitlines() if "no tensor to count tokens" in line]) == 1


def test_train_returns_the_model_in_its_modes_and_leaves_a_copy_made_in_on_step_alone(ctx):
    """After the last step's on_step too the model's recorded modes are put back (it returned in
    evaluation mode); a copy on_step made for its validation keeps the mode on_step gave it."""
    model = seeded(random.randrange(2**31))
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy="local")
    copies = []

    def on_step(stats):
        twin = copy.deepcopy(model).eval()
        copies.append(twin)
        model.eval()

    thd.train(
        prepared.model, prepared.optimizer, regression_batches(2, 4), steps=2, ctx=ctx,
        policy=prepared.policy, on_step=on_step,
    )  # fmt: skip
    assert model.training and all(m.training for m in model.modules())
    assert all(not m.training for twin in copies for m in twin.modules())


class LabelledModel(nn.Module):
    """A Hugging Face-like model: keyword inputs, an output object carrying `loss`."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.head = nn.Linear(DIM, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor):
        logits = self.head(self.embed(input_ids)) * attention_mask[..., None]
        return type(
            "Output", (), {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}
        )


def test_a_mapping_batch_is_given_to_the_model_as_keywords_and_its_output_gives_the_loss(ctx):
    """The default loss called `model(batch)` with the mapping as one positional argument: a
    Hugging Face model given `{"input_ids", "labels", "attention_mask"}` needs `model(**batch)`
    and returns its loss on an output object."""
    vocab, b, t = 11, random.randint(2, 4), random.randint(3, 7)
    batches = [
        {
            "input_ids": torch.randint(0, vocab, (b, t)),
            "labels": torch.randint(0, vocab, (b, t)),
            "attention_mask": (torch.rand(b, t) > 0.2).float(),
        }
        for _ in range(2)
    ]
    torch.manual_seed(3)
    model = LabelledModel(vocab)
    twin = copy.deepcopy(model)
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy="local")
    stats = thd.train(prepared.model, prepared.optimizer, batches, steps=2, ctx=ctx, policy=prepared.policy)
    expected = []
    optimizer = sgd(twin.parameters())
    for batch in batches:
        loss = twin(**batch).loss
        expected.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert [s.loss for s in stats] == pytest.approx(expected, rel=1e-6)
    assert [s.tokens for s in stats] == [b * t] * 2
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)
