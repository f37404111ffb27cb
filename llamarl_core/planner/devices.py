"""The devices the planner knows: each one's published dense peak, memory and links.

Figures are the vendors' datasheet numbers for dense math (no 2:4 sparsity), per
GPU. `nvlink_GBps` and `nic_GBps` are per direction: NVLink's total divided by two,
the node's scale-out NICs divided by its GPUs (one 400 Gbit/s ConnectX-7 per GPU on
an HGX / DGX node: 50 GB/s). `host_GBps` is the link to host memory (PCIe Gen5 x16:
64 GB/s a direction; NVLink-C2C to Grace on GB200). `nvlink_domain` is how many GPUs
one NVLink domain joins (a node of 8; 72 on a GB200 NVL72 rack): a group within it
talks over NVLink, one that spans domains over the NICs. A cluster may override the
links (a row's `cluster`). fp32 math runs as TF32 on tensor cores: half the bf16 peak.

"cpu" is this kind of machine: no table row fits it (machines of one type differ
3-4x), so its figures come from a calibration's measured `device_specs`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace


class PlanError(ValueError):
    """A scenario, model, device or calibration the planner cannot describe, named."""


@dataclass(frozen=True)
class Device:
    name: str
    bf16_tflops: float  # dense peak
    fp8_tflops: float
    hbm_GBps: float  # memory bandwidth
    memory_GiB: float
    nvlink_GBps: float  # per direction, per GPU
    nic_GBps: float  # per direction, per GPU
    host_GBps: float  # per direction, per GPU
    nvlink_domain: int = 0  # GPUs one NVLink domain joins beyond a node (GB200 NVL72: 72); 0: the node

    def peak_flops(self, dtype: str) -> float:
        """FLOP/s of dense math in `dtype`: "fp8", "bf16" / "fp16", "fp32" (TF32: half of bf16)."""
        if dtype == "fp8":
            return self.fp8_tflops * 1e12
        return self.bf16_tflops * 1e12 / (2 if dtype == "fp32" else 1)

    @property
    def hbm(self) -> float:
        return self.hbm_GBps * 1e9

    @property
    def memory_bytes(self) -> float:
        return self.memory_GiB * 2**30

    def link(self, group_span: int, gpus_per_node: int) -> float:
        """Bytes/s per GPU per direction for a group of consecutive GPUs spanning
        `group_span` ranks: NVLink when it stays within one NVLink domain, else the NICs."""
        return (self.nic_GBps if self.crosses(group_span, gpus_per_node) else self.nvlink_GBps) * 1e9

    def crosses(self, group_span: int, gpus_per_node: int) -> bool:
        """Whether `group_span` consecutive ranks leave one NVLink domain (the node, or
        the device's rack-scale domain)."""
        return group_span > (self.nvlink_domain or gpus_per_node)


# Sources: NVIDIA H100 / H200 / H20 / H800 / HGX B200 / GB200 NVL72 datasheets (dense figures).
DEVICES = {
    "H100-SXM-80GB": Device("H100-SXM-80GB", 989.4, 1978.9, 3350, 80, 450, 50, 64),
    "H800-SXM-80GB": Device("H800-SXM-80GB", 989.4, 1978.9, 3350, 80, 200, 50, 64),
    "H20-96GB": Device("H20-96GB", 148, 296, 4000, 96, 450, 50, 64),
    "H200-SXM-141GB": Device("H200-SXM-141GB", 989.4, 1978.9, 4800, 141, 450, 50, 64),
    "B200-180GB": Device("B200-180GB", 2250, 4500, 8000, 180, 900, 50, 64),
    "GB200-186GB": Device("GB200-186GB", 2500, 5000, 8000, 186, 900, 100, 450, nvlink_domain=72),
}
ALIASES = {"H100": "H100-SXM-80GB", "H800": "H800-SXM-80GB", "H20": "H20-96GB", "H200": "H200-SXM-141GB",
           "B200": "B200-180GB", "GB200": "GB200-186GB"}
CPU = "cpu"


def positive_number(value) -> bool:
    """Whether `value` is a number (not a bool), positive and finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def device(name: str, measured: dict | None = None) -> Device:
    """The Device called `name` (a table name or its short alias, any case), or "cpu"
    from `measured` (a calibration's `device_specs`: the Device fields it measured).
    PlanError naming the device when it is in neither."""
    key = ALIASES.get(str(name).upper(), str(name))
    by_upper = {k.upper(): k for k in DEVICES}
    key = by_upper.get(key.upper(), key)
    if key in DEVICES:
        base = DEVICES[key]
        return replace(base, **measured) if measured else base
    if str(name).lower() == CPU:
        if not measured:
            raise PlanError("device 'cpu' has no published figures: a row on it needs a calibration holding the "
                            "machine's measured figures (device_specs); a `llamarl train` run of this machine is "
                            "predicted from its config.json under `llamarl plan calibrate`'s calibration instead")
        fields = [f.name for f in dataclasses.fields(Device) if f.name not in ("name", "nvlink_domain")]
        missing = [f for f in fields if not positive_number(measured.get(f))]
        unknown = sorted(set(measured) - set(fields) - {"nvlink_domain"})
        if missing or unknown:
            raise PlanError(f"device 'cpu': its measured figures (device_specs) need a positive {', '.join(fields)}; "
                            f"missing or not a positive number: {missing}, unknown: {unknown}")
        domain = measured.get("nvlink_domain")
        if domain is not None and (isinstance(domain, bool) or not isinstance(domain, int) or domain < 1):
            raise PlanError(f"device 'cpu': device_specs.nvlink_domain must be a positive integer (GPUs a fast "
                            f"link joins) or null, got {domain!r}")
        return Device(name=CPU, **measured)
    raise PlanError(f"device {name!r} is not in the planner's table: one of {sorted(DEVICES)} (or their short "
                    f"names {sorted(ALIASES)}), or 'cpu' with a calibration")
