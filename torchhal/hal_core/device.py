"""Device: a handle on one physical device behind one adapter."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torchhal.hal_core.capabilities import DType
from torchhal.hal_core.errors import UnsupportedError

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core.adapter import DeviceTimer, VendorAdapter
    from torchhal.hal_core.capabilities import DeviceCapabilities, HealthReport, MemoryInfo


class Device:
    """What subsystems hold instead of a vendor API: identity, capabilities and device services."""

    __slots__ = ("_torch_device", "adapter", "capabilities", "id")

    def __init__(self, adapter: VendorAdapter, capabilities: DeviceCapabilities) -> None:
        self.adapter = adapter
        self.capabilities = capabilities
        self.id = adapter.device_id(capabilities.index, capabilities.device_type)
        self._torch_device: torch.device | None = None

    @property
    def torch_device(self) -> torch.device:
        """Where this device's tensors live, as torch names it."""
        if self._torch_device is None:
            import torch

            caps = self.capabilities
            self._torch_device = (
                torch.device("cpu")
                if caps.device_type == "cpu"
                else torch.device(caps.device_type, caps.index)
            )
        return self._torch_device

    @property
    def index(self) -> int:
        return self.capabilities.index

    @property
    def simulated(self) -> bool:
        return self.capabilities.simulated

    def synchronize(self) -> None:
        self.adapter.synchronize(self.index)

    def memory_info(self) -> MemoryInfo:
        return self.adapter.memory_info(self.index)

    def health(self) -> HealthReport:
        return self.adapter.health(self.index)

    def timer(self) -> DeviceTimer:
        return self.adapter.timer(self.index)

    def capturing(self) -> bool:
        """Whether this device's current stream is capturing a graph (`VendorAdapter.capturing`)."""
        return self.adapter.capturing(self.index)

    def graph_replay(self, work: Callable[[], object]) -> Callable[[], None]:
        """`work` captured as a device graph; the callable returned replays it
        (`VendorAdapter.graph_replay`)."""
        return self.adapter.graph_replay(self.index, work)

    def numerics_settings(self) -> dict[str, Any]:
        """Its runtime's switches that change results or timings (`VendorAdapter.numerics_settings`)."""
        return self.adapter.numerics_settings()

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised memory on this device. A format torchhal tracks (`DType`: what devices
        compute in) must be declared; any other dtype (int64 labels, int32 indices, bool masks)
        is the adapter's to store or refuse: no device could declare one, so each was refused."""
        if DType.from_torch(dtype) is not None:
            self.require_dtype(dtype, what="allocation")
        return self.adapter.allocate(self.index, self.torch_device, shape, dtype)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """An explicit copy of `tensor` onto this device, same dtype (never converted)."""
        out = self.empty(tensor.shape, tensor.dtype)
        return self.adapter.copy_(self.index, out, tensor)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return self.adapter.copy_(self.index, dst, src)

    def require_dtype(self, dtype: torch.dtype, *, what: str) -> None:
        if not self.capabilities.supports_dtype(dtype):
            declared = ", ".join(sorted(d.value for d in self.capabilities.dtypes))
            raise UnsupportedError(
                f"{what} on {self.id}: dtype {dtype} is not supported by this device "
                f"(declared dtypes: {declared})"
            )

    def __repr__(self) -> str:
        caps = self.capabilities
        sim = ", simulated" if caps.simulated else ""
        return f"Device({self.id!r}, {caps.name!r}, {caps.arch}{sim})"
