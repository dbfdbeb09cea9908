"""What the planner assumes of the machines: one frozen record per GPU kind, each figure
overridable from the command line (tools/plan.py). The defaults are public datasheet figures
derated to what collectives and GEMMs reach in practice (NOTES.md: a large bf16 GEMM reaches
about 790 of the H200's 989 TFLOP/s)."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

GiB = 2 ** 30


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int  # per GPU
    peak_tflops: float  # dense bf16
    achievable_tflops: float  # what a step's GEMMs sustain on average (the roofline's compute ceiling)
    nvlink_gbps: float  # GB/s per GPU a ring collective sustains inside a node (bus bandwidth)
    network_gbps: float  # GB/s per GPU across nodes (8 x 400 Gb/s InfiniBand per 8-GPU node, derated)
    host_link_gbps: float  # GB/s per GPU between host and device (PCIe Gen5 x16, one direction)
    host_adam_gparams: float  # billions of fp32 Adam elements per second the host steps per GPU
    hbm_gbps: float  # memory bandwidth, for the optimizer step
    gpus_per_node: int = 8
    reserved_bytes: int = 3 * GiB  # CUDA context, NCCL buffers, allocator fragmentation
    fp8_rate: float = 2.0  # dense FP8 GEMM rate over bf16's (Hopper: 1979 / 989 TFLOP/s); 0: no FP8 tensor cores

    def with_(self, **kw) -> "Hardware":
        return replace(self, **kw)

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes


GPUS = {
    "H100": Hardware("H100-SXM 80GB", 80 * GiB, 989.0, 600.0, 360.0, 40.0, 50.0, 1.0, 3000.0),
    "H200": Hardware("H200-SXM 141GB", 141 * GiB, 989.0, 600.0, 360.0, 40.0, 50.0, 1.0, 4300.0),
    "A100": Hardware("A100-SXM 80GB", 80 * GiB, 312.0, 200.0, 230.0, 20.0, 25.0, 1.0, 2000.0, fp8_rate=0.0),
}


def parse_bytes(text: str) -> int:
    """'80GB', '80GiB', '141G', '1.5TB' -> bytes; GB and G are read as GiB (a GPU's "80GB")."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a memory size from {text!r}: write e.g. 80GB")
    scale = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": GiB, "T": 2 ** 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)
