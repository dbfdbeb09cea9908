"""The files of a checkpoint: atomic writes, and per-rank safetensors files of pieces.

A rank's file is plain safetensors (readable by `safetensors.safe_open`, nothing is pickled). The
writer here streams each tensor's bytes straight from its memory, so that a background save
needs no serialized copy of the whole file and releases the GIL while the OS writes. Every file
is written to a temporary name, fsynced, then renamed: a file with its final name is complete.
"""
from __future__ import annotations

import json
import math
import os
import struct
import time
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open

from ..errors import ConfigError
from .geometry import Box

DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}

# bytes per element of safetensors' dtype names (a name not here: only the offsets' bounds are checked)
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}

PIECES = "pieces"  # key of the piece index in each file's safetensors metadata
FORMAT = "megatron-lite-checkpoint"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded; the message names the file, tensor or field. A
    ConfigError, so that pretrain_gpt.py and the tools report it in one line."""


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot sync a directory
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    """Replace `path` by `text` so that readers see the old or the new content, never a mix."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _header(tensors: Sequence[Tuple[str, Sequence[int], torch.dtype]], metadata: Dict[str, str]) -> bytes:
    """The safetensors header of tensors (name, shape, dtype) stored back to back in this order."""
    entries, offset = {}, 0
    for name, shape, dtype in tensors:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        entries[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    entries["__metadata__"] = metadata
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes with spaces


def write_safetensors(path: str, tensors: List[Tuple[str, torch.Tensor]], metadata: Dict[str, str],
                      halfway: Optional[Callable] = None) -> int:
    """Write CPU tensors as a safetensors file, atomically; returns its size in bytes.
    `halfway(file)` is called with half the tensors written (the crash tests' fault hook)."""
    tensors = [(name, t.contiguous()) for name, t in tensors]
    header = _header([(name, t.shape, t.dtype) for name, t in tensors], metadata)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for i, (_, t) in enumerate(tensors):
            if i == len(tensors) // 2 and halfway is not None:
                halfway(f)
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return os.path.getsize(path)


class PinnedHostBuffers:
    """Page-locked host copies of device tensors for --async-save, kept from one save to the next
    (saves never overlap: the manager finishes one before it snapshots again). The device-to-host
    copies are issued without blocking and waited for once per save, by the writer. A synchronous
    save copies into ordinary memory instead (nothing stays locked between saves)."""

    def __init__(self):
        self.buffers: Dict[str, torch.Tensor] = {}

    def copy(self, name: str, data: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.shape != data.shape or buf.dtype != data.dtype:
            buf = self.buffers[name] = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        return buf.copy_(data, non_blocking=True)



class PieceSet:
    """The pieces one rank writes: tensors named `<key>@<box start>`, and the index that says
    which box of which full tensor each one is (kept in the file's safetensors metadata)."""

    def __init__(self, host: Optional[PinnedHostBuffers] = None):
        self.tensors: List[Tuple[str, torch.Tensor]] = []
        self.index: Dict[str, list] = {}
        self.checksum_s = 0.0  # time spent computing the checksums (benchmarks)
        self.host = host if host is not None else PinnedHostBuffers()  # (the manager keeps one across saves)
        self.pending_device = None  # the device whose copies are still in flight

    def add(self, key: str, box: Box, full_shape: Sequence[int], data: torch.Tensor, copy: bool = False) -> None:
        name = f"{key}@" + ",".join(str(s) for s, _ in box)
        data = data.detach()
        if data.device.type == "cuda" and copy:  # an asynchronous save: training goes on at once
            data, self.pending_device = self.host.copy(name, data), data.device
        elif copy or data.device.type != "cpu":
            data = data.to("cpu", copy=True)
        self.tensors.append((name, data))
        self.index[name] = [key, [list(d) for d in box], list(full_shape)]

    def copies_issued(self) -> None:
        """Mark the end of the device-to-host copies (an event on the stream that runs them):
        training may go on at once; the writer waits for the event, not for the training."""
        if self.pending_device is not None:
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(self.pending_device))
            self.pending_device = None

    def wait_copies(self) -> None:
        """The writer's one wait of a save: every device-to-host copy has landed."""
        self.copies_issued()
        if getattr(self, "copied", None) is not None:
            self.copied.synchronize()
            self.copied = None

    def write(self, path: str, halfway: Optional[Callable] = None) -> int:
        """Write the file; each piece's index entry gets the CRC-32 of its bytes (verified on load)."""
        self.wait_copies()
        start = time.perf_counter()
        for name, t in self.tensors:
            self.index[name] = self.index[name][:3] + [tensor_crc32(t)]
        self.checksum_s = time.perf_counter() - start
        return write_safetensors(path, self.tensors, {"format": FORMAT, PIECES: json.dumps(self.index)}, halfway)


def tensor_crc32(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes as they are written (zlib releases the GIL on big buffers)."""
    t = t.contiguous()
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().data) if t.numel() else 0


def bytes_crc32(data) -> int:
    return zlib.crc32(data)


def metadata_checksum(meta: dict) -> int:
    """CRC-32 of metadata.json's content without its own `checksum` field (canonical JSON)."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def read_header(path: str) -> Tuple[int, dict]:
    """(offset of the data section, header entries) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        size = os.fstat(f.fileno()).st_size
        if n > size - 8:  # read nothing a damaged length claims (10^12 bytes: a MemoryError)
            raise ValueError(f"the header claims {n} bytes but the file has {size}")
        entries = json.loads(f.read(n))
    _check_offsets(entries, size - 8 - n)
    return 8 + n, entries


def _check_offsets(entries: dict, data_bytes: int) -> None:
    """Every tensor's data_offsets inside the data section, its bytes matching its shape and
    dtype: a damaged entry would otherwise be an allocation of what it claims (10^12 bytes)."""
    for name, e in entries.items():
        if name == "__metadata__":
            continue
        try:
            lo, hi = (int(x) for x in e["data_offsets"])
            numel = math.prod(int(d) for d in e["shape"])
            itemsize = DTYPE_BYTES.get(e["dtype"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name}'s header entry is malformed: {e}") from None
        if not 0 <= lo <= hi <= data_bytes or (itemsize is not None and hi - lo != numel * itemsize):
            raise ValueError(f"tensor {name} claims bytes [{lo}, {hi}) for shape {e['shape']} {e['dtype']}, but "
                             f"the data section has {data_bytes} bytes")


class StreamingPieceFile:
    """A rank's checkpoint file written piece by piece as the data arrives (converters stream a
    model tensor by tensor, so that no more than one full tensor is in memory): the pieces are
    declared first, the header is reserved at its largest size, the data follows in declaration
    order, and the header with every piece's CRC-32 is written last (padded with spaces, which
    safetensors allows). The file appears under its final name only when complete."""
    _CRC_PLACEHOLDER = 0xFFFFFFFF  # the widest CRC-32 in decimal: reserves room for any

    def __init__(self, path: str):
        self.path, self.tmp = path, f"{path}.tmp"
        self.order: List[Tuple[str, torch.Size, torch.dtype]] = []
        self.index: Dict[str, list] = {}
        self.crcs: List[int] = []
        self.file = None

    def declare(self, key: str, box: Box, full_shape: Sequence[int], dtype: torch.dtype) -> str:
        name = f"{key}@" + ",".join(str(s) for s, _ in box)
        self.order.append((name, torch.Size([n for _, n in box]), dtype))
        self.index[name] = [key, [list(d) for d in box], list(full_shape)]
        return name

    def _header(self, crcs: Sequence[int]) -> bytes:
        index = {name: entry + [crc] for (name, entry), crc in zip(self.index.items(), crcs)}
        return _header(self.order, {"format": FORMAT, PIECES: json.dumps(index)})

    def open(self) -> None:
        self.reserved = len(self._header([self._CRC_PLACEHOLDER] * len(self.order)))
        self.file = open(self.tmp, "wb")
        self.file.write(struct.pack("<Q", self.reserved) + b" " * self.reserved)

    def write(self, name: str, data: torch.Tensor) -> None:
        expected, shape, dtype = self.order[len(self.crcs)]
        assert name == expected and data.shape == shape and data.dtype == dtype, (name, expected)
        data = data.contiguous()
        self.crcs.append(tensor_crc32(data))
        if data.numel():
            self.file.write(data.reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> int:
        assert len(self.crcs) == len(self.order), f"{self.path}: {len(self.order) - len(self.crcs)} pieces unwritten"
        header = self._header(self.crcs)
        self.file.seek(8)
        self.file.write(header + b" " * (self.reserved - len(header)))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        return os.path.getsize(self.path)


def describe_files(directory: str, names: Sequence[str]) -> Dict[str, dict]:
    """metadata.json's `files`: per file its size and its piece index (read from its header)."""
    out = {}
    for name in names:
        path = os.path.join(directory, name)
        with safe_open(path, framework="pt") as f:
            pieces = json.loads(f.metadata()[PIECES])
        out[name] = {"bytes": os.path.getsize(path), PIECES: pieces}
    return out
