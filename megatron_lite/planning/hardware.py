"""What the planner assumes of the machines: one frozen record per GPU kind, each figure
overridable from the command line or a JSON file (tools/plan.py), and the bandwidth a collective
gets from where its group's ranks sit (how many share a node).

Where the defaults come from (one set for every plan; benchmarks/RESULTS.md checks them against
published runs):
  - gemm_tflops: the sustained bf16 matmul rate, stas00/ml-engineering's mamf-finder "MSMF"
    (power-saturated, all 8 GPUs of a node busy): H200 about 700 of 989 TFLOP/s; the H100 SXM and
    the H800 are the same silicon and power (700 W); the A100 SXM its MAMF, 271 of 312 (it does not
    throttle). NOTES.md's 8192^3 on the lent H200 (769-798) is the short-burst figure.
  - attention_tflops: a fused causal flash-attention forward + backward at head size 128, in the
    FLOPs the kernel does (FlashAttention-3 paper, Shah et al. 2024: cuDNN / FA2 on H100 about
    400-500 forward, 350-450 backward); the A100: FlashAttention-2's paper, about 190.
  - hbm_gbps: what a streaming kernel reaches, 90 % of the datasheet (NOTES.md: 4.3 of 4.8 TB/s
    copied on the H200).
  - nvlink_gbps: NCCL's ring bus bandwidth inside an NVSwitch node (H100 / H200: about 360 of
    450 GB/s a direction); the H800's NVLink is cut to 400 GB/s both ways, DeepSeek-V3's report
    measures 160 GB/s.
  - network_gbps: one 400 Gb/s NIC per GPU (DeepSeek-V3's report: 50 GB/s InfiniBand; the A100's
    200 Gb/s), at 90 % as the memory; a group with k ranks in a node drives k NICs (NCCL runs one
    ring channel through each), so its ring collectives get k times this, up to NVLink's.
  - nvme_gbps (--optimizer-offload-nvme-path): an assumption, not measured: one PCIe Gen4
    data-centre NVMe drive per GPU (a DGX H100 node has eight U.2 drives for data), whose
    datasheets give about 7 GB/s sequential read and 3.5-4 GB/s write; the write rate is taken for
    both, as a step reads and writes the same bytes through the one drive. Override it with the
    measured rate of the run's disk (--nvme-gbps; e.g. fio or dd with O_DIRECT on the file system).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields, replace

GiB = 2 ** 30


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int  # per GPU
    peak_tflops: float  # dense bf16 (the MFU denominator)
    gemm_tflops: float  # sustained bf16 GEMM rate of large shapes (MSMF); smaller shapes pay their operand traffic
    attention_tflops: float  # fused causal attention, forward + backward, in the FLOPs the kernel does
    nvlink_gbps: float  # GB/s per GPU a ring collective sustains inside a node (bus bandwidth)
    network_gbps: float  # GB/s per GPU across nodes (one NIC per GPU, derated)
    host_link_gbps: float  # GB/s per GPU between host and device (PCIe Gen5 x16, one direction)
    host_adam_gparams: float  # billions of fp32 Adam elements per second the host steps per GPU
    hbm_gbps: float  # memory bandwidth a streaming kernel reaches: elementwise work, GEMM operands, optimizer
    gpus_per_node: int = 8
    reserved_bytes: int = 3 * GiB  # CUDA context, NCCL buffers, allocator fragmentation
    fp8_rate: float = 2.0  # dense FP8 GEMM rate over bf16's (Hopper: 1979 / 989 TFLOP/s); 0: no FP8 tensor cores
    nvme_gbps: float = 3.5  # GB/s per GPU its NVMe offload file is read and written at (an assumption, above)

    def with_(self, **kw) -> "Hardware":
        return replace(self, **kw)

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved_bytes


GPUS = {
    "H100": Hardware("H100-SXM 80GB", 80 * GiB, 989.0, 700.0, 400.0, 360.0, 45.0, 50.0, 1.0, 3000.0),
    "H200": Hardware("H200-SXM 141GB", 141 * GiB, 989.0, 700.0, 400.0, 360.0, 45.0, 50.0, 1.0, 4300.0),
    "H800": Hardware("H800-SXM 80GB", 80 * GiB, 989.0, 700.0, 400.0, 160.0, 45.0, 50.0, 1.0, 3000.0),
    "A100": Hardware("A100-SXM 80GB", 80 * GiB, 312.0, 271.0, 190.0, 230.0, 22.0, 25.0, 1.0, 1800.0, fp8_rate=0.0),
}


def from_json(base: Hardware, path: str) -> Hardware:
    """A JSON object of Hardware fields (e.g. {"gemm_tflops": 650, "hbm_gbps": 2100}) over `base`."""
    try:
        with open(path) as f:
            over = json.load(f)
    except OSError as e:
        raise ValueError(f"--hardware-file {path}: {e.strerror}; give a JSON file of GPU fields") from None
    known = {f.name: f.type for f in fields(Hardware)}
    if not isinstance(over, dict) or set(over) - set(known):
        bad = sorted(set(over) - set(known)) if isinstance(over, dict) else over
        raise ValueError(f"--hardware-file {path}: unknown fields {bad}; use some of: {', '.join(known)}")
    for k, v in over.items():
        if k != "name" and (not isinstance(v, (int, float)) or v < 0):
            raise ValueError(f"--hardware-file {path}: {k} must be a non-negative number, not {v!r}")
    return base.with_(**over)


def parse_bytes(text: str) -> int:
    """'80GB', '80GiB', '141G', '1.5TB' -> bytes; GB and G are read as GiB (a GPU's "80GB")."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a memory size from {text!r}: write e.g. 80GB")
    scale = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": GiB, "T": 2 ** 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


# --- where a group sits -----------------------------------------------------------------------
# Ranks follow Megatron's order (tp-cp-ep-dp-pp; the expert grid etp-ep-edp-pp): a group of
# `size` ranks `stride` apart has min(size, gpus_per_node / stride) of them in each node.

def ranks_per_node(hw: Hardware, size: int, stride: int) -> int:
    return max(1, min(size, hw.gpus_per_node // stride)) if stride < hw.gpus_per_node else 1


def ring_seconds(hw: Hardware, nbytes: float, size: int, stride: int) -> float:
    """A ring collective moving `nbytes` per rank (already scaled by its (n-1)/n factors): over
    NVLink inside a node; across nodes each node's k ranks drive k NICs, up to NVLink's rate."""
    if size <= 1:
        return 0.0
    k = ranks_per_node(hw, size, stride)
    bw = hw.nvlink_gbps if k >= size else min(hw.nvlink_gbps, k * hw.network_gbps)
    return nbytes / (bw * 1e9)


def all_to_all_seconds(hw: Hardware, nbytes: float, size: int, stride: int) -> float:
    """An all-to-all of `nbytes` per rank, evenly spread: the share for the k - 1 peers in the node
    crosses NVLink while the share for the other nodes crosses this GPU's NIC, both at once."""
    if size <= 1:
        return 0.0
    k = ranks_per_node(hw, size, stride)
    inside, outside = nbytes * (k - 1) / size, nbytes * (size - k) / size
    return max(inside / (hw.nvlink_gbps * 1e9), outside / (hw.network_gbps * 1e9))


def p2p_seconds(hw: Hardware, nbytes: float, stride: int) -> float:
    """A send to the rank `stride` away: NVLink when it is in the same node."""
    return nbytes / ((hw.nvlink_gbps if stride < hw.gpus_per_node else hw.network_gbps) * 1e9)
