"""choose_precision on recorded devices: bf16, fp16 with a scaler, or fp32, each with its reason."""

from __future__ import annotations

import io
import json

import pytest
import torch
from torchhal_amd.adapter import AmdAdapter
from torchhal_amd.recorded import RecordedRocmProbe
from torchhal_nvidia.adapter import NvidiaAdapter
from torchhal_nvidia.recorded import RecordedCudaProbe
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.spec import bundled_spec

from tests.core.adapters import FakeAdapter, fake_caps
from tests.plugins.facts import load
from torchhal.distributed import choose_precision
from torchhal.hal_core import Device, DType, Feature, UnsupportedError, telemetry
from torchhal.hal_core.adapters.cpu import CPUAdapter


def first_device(adapter) -> Device:
    return Device(adapter, adapter.discover()[0])


def fake_device(**caps) -> Device:
    adapter = FakeAdapter([fake_caps(**caps)])
    return first_device(adapter)


@pytest.mark.parametrize(
    ("adapter", "device_type"),
    [
        (lambda: NvidiaAdapter(probe=RecordedCudaProbe(load("nvidia-h200x2"))), "cuda"),
        (lambda: AmdAdapter(probe=RecordedRocmProbe(load("amd-mi300x"))), "cuda"),
    ],
    ids=["h200", "mi300x"],
)
def test_recorded_gpus_with_matrix_units_train_in_bf16(adapter, device_type):
    device = first_device(adapter())
    policy = choose_precision(device)
    assert (policy.name, policy.compute_dtype, policy.reduce_dtype) == ("bf16", torch.bfloat16, torch.float32)
    assert policy.device_type == device_type and not policy.uses_grad_scaler and policy.grad_scaler() is None
    assert "matrix units (tensor_cores)" in policy.reason and device.id in policy.reason


def test_a_device_without_bf16_trains_in_fp16_with_a_gradient_scaler():
    device = fake_device(dtypes=frozenset({DType.FP32, DType.FP16}))  # a V100-class part
    policy = choose_precision(device)
    assert (policy.name, policy.compute_dtype) == ("fp16", torch.float16)
    assert "passed over: bf16: not declared" in policy.reason
    scaler = policy.grad_scaler()
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
    assert policy.grad_scaler() is not scaler  # a fresh scaler each time: its state belongs to one run


def test_the_host_cpu_trains_in_fp32_and_says_why():
    policy = choose_precision(first_device(CPUAdapter()))
    assert (policy.name, policy.compute_dtype) == ("fp32", torch.float32)
    assert policy.reason == (
        "cpu: fp32 (bf16: declared, but no matrix units or declared peak above fp32; "
        "fp16: declared, but no matrix units or declared peak above fp32)"
    )
    assert policy.report()["autocast"] is False


def test_a_simulated_asic_with_a_faster_declared_bf16_peak_trains_in_bf16():
    policy = choose_precision(first_device(SimASICAdapter(bundled_spec("edge"))))
    assert policy.name == "bf16" and policy.device_type == "cpu"
    assert "declared bf16 peak of 13.1072 TFLOP/s above fp32's 6.5536" in policy.reason


def test_a_faster_declared_peak_without_bf16_storage_is_not_enough():
    device = fake_device(dtypes=frozenset({DType.FP32}), features=frozenset())
    assert choose_precision(device).name == "fp32"


def test_a_requested_format_is_used_when_declared_and_refused_otherwise():
    cpu = first_device(CPUAdapter())
    policy = choose_precision(cpu, prefer="bf16")
    assert (policy.name, policy.reason) == ("bf16", "requested; cpu declares bf16")
    no_fp16 = fake_device(dtypes=frozenset({DType.FP32, DType.BF16}))
    with pytest.raises(
        UnsupportedError, match=r"precision 'fp16' on acme:0: the device does not declare fp16 "
    ):
        choose_precision(no_fp16, prefer="fp16")
    with pytest.raises(UnsupportedError, match=r"precision must be one of .*got 'fp8'"):
        choose_precision(cpu, prefer="fp8")


def test_a_device_with_no_trainable_format_is_refused():
    device = fake_device(dtypes=frozenset({DType.INT8}), features=frozenset({Feature.TENSOR_CORES}))
    with pytest.raises(UnsupportedError, match=r"needs bf16, fp16 or fp32; the device declares int8"):
        choose_precision(device)


def test_the_choice_is_counted_logged_and_reported():
    key = "torchhal.distributed.precision,device=acme:0,policy=bf16"
    before = telemetry.counts().get(key, 0)
    telemetry.configure(log_level="info", log_format="json", log_stream=(stream := io.StringIO()))
    policy = choose_precision(fake_device())
    assert telemetry.counts()[key] == before + 1
    (line,) = [json.loads(x) for x in stream.getvalue().splitlines() if "precision policy chosen" in x]
    assert (line["device"], line["policy"]) == ("acme:0", "bf16") and "matrix units" in line["reason"]
    assert policy.report() == {
        "policy": "bf16",
        "compute_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "grad_scaler": False,
        "autocast": True,
        "device_type": "cpu",
        "strategy": None,
        "reason": "acme:0 declares bf16 and matrix units (tensor_cores)",
    }


def test_autocast_runs_matmuls_in_the_compute_dtype_and_fsdp_gets_its_own_policy():
    policy = choose_precision(first_device(CPUAdapter()), prefer="bf16")
    layer = torch.nn.Linear(8, 4)
    with policy.for_strategy("ddp").autocast():
        assert layer(torch.randn(3, 8)).dtype == torch.bfloat16
    with policy.for_strategy("fsdp").autocast():  # FSDP casts parameters; no autocast on top
        assert layer(torch.randn(3, 8)).dtype == torch.float32
    mp = policy.fsdp_policy()
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp32 = choose_precision(first_device(CPUAdapter()))
    with fp32.for_strategy("ddp").autocast():
        assert layer(torch.randn(3, 8)).dtype == torch.float32
    assert (fp32.fsdp_policy().param_dtype, fp32.fsdp_policy().reduce_dtype) == (None, None)
    with pytest.raises(UnsupportedError, match=r"strategy must be one of .*got 'zero3'"):
        policy.for_strategy("zero3")
