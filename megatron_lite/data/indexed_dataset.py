"""Megatron-LM's indexed dataset format: a `.bin` of tokens and an `.idx` that indexes it.

`.idx` layout (little-endian): magic b"MMIDIDX\\x00\\x00", version uint64 (1), dtype code uint8,
sequence count uint64, document count uint64 (documents + 1), then sequence lengths
int32[sequences], sequence byte pointers int64[sequences], document indices int64[documents + 1].
Files written here load in Megatron-LM and the reverse; both files are memory-mapped, so opening
a 100 GB corpus reads only its header.
"""
from __future__ import annotations

import hashlib
import os
import struct
from typing import List, Optional, Sequence

import numpy as np

from megatron_lite.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """uint16 when every token id fits (ids < 65536), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size <= 65536 else np.int32


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def _atomic_target(path: str) -> str:
    return f"{path}.tmp.{os.getpid()}"


class IndexedDatasetWriter:
    """Streams documents into `{prefix}.bin` and writes `{prefix}.idx` on `finalize()`.

    Both files are written under temporary names and renamed at the end, so a reader never
    sees a half-written dataset (and an interrupted run leaves no plausible-looking output)."""

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ConfigError(f"{prefix}: dtype {self.dtype} has no Megatron dtype code")
        self._bin_tmp = _atomic_target(bin_path(prefix))
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: List[np.ndarray] = []
        self._doc_ends: List[int] = []  # sequence count after each document
        self._num_sequences = 0
        self.num_tokens = 0

    def add_document(self, tokens: np.ndarray, lengths: Optional[Sequence[int]] = None) -> None:
        """Append one document; `lengths` splits it into sequences (sentences), default one."""
        tokens = np.asarray(tokens)
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        lengths = np.asarray([tokens.size] if lengths is None else lengths, dtype=np.int64)
        if lengths.sum() != tokens.size:
            raise ValueError(f"sequence lengths sum to {lengths.sum()} but the document has {tokens.size} tokens")
        self.add_documents(tokens, lengths, np.array([lengths.size], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, seq_lengths: np.ndarray, seqs_per_doc: np.ndarray) -> None:
        """Append many documents at once: tokens back to back, each sequence's length, and
        how many sequences each document has. The bulk path used by the preprocessing tool."""
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        self._bin.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        self._lengths.append(np.asarray(seq_lengths, dtype=np.int32))
        ends = self._num_sequences + np.cumsum(seqs_per_doc, dtype=np.int64)
        self._doc_ends.extend(ends.tolist())
        self._num_sequences += int(np.sum(seqs_per_doc))
        self.num_tokens += int(tokens.size)

    @property
    def num_documents(self) -> int:
        return len(self._doc_ends)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        doc_indices = np.array([0] + self._doc_ends, dtype=np.int64)
        os.replace(self._bin_tmp, bin_path(self.prefix))
        # The .idx lands last: a reader that finds it also finds the complete .bin.
        write_index(idx_path(self.prefix), self.dtype, lengths, doc_indices, atomic=True)

    def abort(self) -> None:
        self._bin.close()
        if os.path.exists(self._bin_tmp):
            os.remove(self._bin_tmp)


def write_index(path: str, dtype, lengths: np.ndarray, doc_indices: np.ndarray, atomic: bool = True) -> None:
    """Write an `.idx` for sequences of `lengths` tokens of `dtype` laid out back to back."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    target = _atomic_target(path) if atomic else path
    with open(target, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[dtype], lengths.size, doc_indices.size))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(np.asarray(doc_indices, dtype=np.int64).tobytes(order="C"))
    if atomic:
        os.replace(target, path)


class IndexedDataset:
    """Memory-mapped reader of a Megatron `.bin`/`.idx` pair.

    Construction validates the header and the sizes of both files and raises `ConfigError`
    naming the file and the problem; nothing is read from the `.bin` until a sequence is asked for.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.idx_file, self.bin_file = idx_path(prefix), bin_path(prefix)
        self._digest: Optional[str] = None
        _check_files_exist(prefix)
        self._read_index()
        self._map_bin()

    def _read_index(self) -> None:
        size = os.path.getsize(self.idx_file)
        with open(self.idx_file, "rb") as f:
            head = f.read(_HEADER.size)
        if head[:len(MAGIC)] != MAGIC:
            raise ConfigError(f"{self.idx_file}: wrong magic {head[:9]!r}, expected {MAGIC!r}; "
                              f"not a Megatron indexed dataset index")
        if len(head) < _HEADER.size:
            raise ConfigError(f"{self.idx_file}: truncated header ({size} bytes, need {_HEADER.size})")
        _, version, code, n_seq, n_doc = _HEADER.unpack(head)
        if version != VERSION:
            raise ConfigError(f"{self.idx_file}: unsupported index version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise ConfigError(f"{self.idx_file}: unknown dtype code {code} (valid: 1-8)")
        self.dtype = np.dtype(DTYPE_CODES[code])
        need = _HEADER.size + n_seq * (4 + 8) + n_doc * 8
        if size < need:
            raise ConfigError(f"{self.idx_file}: truncated index: {size} bytes, but {n_seq} sequences and "
                              f"{n_doc} document indices need {need}")
        if n_doc < 1:
            raise ConfigError(f"{self.idx_file}: document index is empty (need at least the leading 0)")
        self._idx_map = np.memmap(self.idx_file, mode="r", dtype=np.uint8, shape=(need,))
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(self._idx_map, np.int32, n_seq, off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(self._idx_map, np.int64, n_seq, off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(self._idx_map, np.int64, n_doc, off)
        self._check_index()

    def _check_index(self) -> None:
        n = len(self.sequence_lengths)
        docs = self.document_indices
        if docs[0] != 0 or docs[-1] != n or (len(docs) > 1 and np.any(np.diff(docs) < 0)):
            raise ConfigError(f"{self.idx_file}: document indices must rise from 0 to the sequence count {n}")
        if n == 0:
            return
        if np.any(self.sequence_lengths < 0):
            raise ConfigError(f"{self.idx_file}: negative sequence length")
        expected = np.zeros(n, dtype=np.int64)
        np.cumsum(self.sequence_lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=expected[1:])
        if not np.array_equal(expected, self.sequence_pointers):
            raise ConfigError(f"{self.idx_file}: sequence pointers disagree with sequence lengths")

    def _map_bin(self) -> None:
        n = len(self.sequence_lengths)
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        need = self.num_tokens * self.dtype.itemsize
        size = os.path.getsize(self.bin_file)
        if size < need:
            raise ConfigError(f"{self.bin_file}: truncated: {size} bytes, but its index {self.idx_file} "
                              f"describes {self.num_tokens} {self.dtype} tokens = {need} bytes")
        if size % self.dtype.itemsize:
            raise ConfigError(f"{self.bin_file}: size {size} is not a multiple of the {self.dtype} "
                              f"token size named in {self.idx_file}")
        if need == 0:
            self._bin = np.zeros(0, dtype=self.dtype)
        else:
            self._bin = np.memmap(self.bin_file, mode="r", dtype=self.dtype, shape=(self.num_tokens,))
        self._starts = (self.sequence_pointers // self.dtype.itemsize) if n else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def tokens(self) -> np.ndarray:
        """All tokens back to back (a memory map; slicing reads only what is sliced)."""
        return self._bin

    def content_digest(self) -> str:
        """SHA-256 of the `.idx` (sequence lengths, pointers, documents): what the sample indices
        are built from. Unlike size and mtime, it changes whenever the corpus is replaced by one
        with different documents, even by `cp -p`, `rsync -a` or `tar x`. Computed once."""
        if self._digest is None:
            self._digest = hashlib.sha256(memoryview(self._idx_map)).hexdigest()
        return self._digest

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens of sequence i from `offset`, `length` of them (default: to its end). A read that
        runs past the sequence is an error (a stale or corrupt sample index), never its neighbour."""
        n = len(self.sequence_lengths)
        if not 0 <= i < n:
            raise IndexError(f"{self.prefix}: sequence {i} does not exist ({n} sequences)")
        size = int(self.sequence_lengths[i])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) of sequence {i} asked for, but "
                             f"it has {size}: the sample index does not belong to this corpus (stale cache?)")
        start = int(self._starts[i]) + offset
        return self._bin[start:start + length]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def document(self, d: int) -> np.ndarray:
        """All tokens of document d (its sequences concatenated)."""
        s, e = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if s == e:
            return self._bin[0:0]
        start = int(self._starts[s])
        return self._bin[start:start + int(self.sequence_lengths[s:e].sum())]


def _check_files_exist(prefix: str) -> None:
    has_idx, has_bin = os.path.isfile(idx_path(prefix)), os.path.isfile(bin_path(prefix))
    if not has_idx and not has_bin:
        hint = " (give the prefix without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
        raise ConfigError(f"data path {prefix}: no such dataset, neither {bin_path(prefix)} nor "
                          f"{idx_path(prefix)} exists{hint}")
    if not has_idx:
        raise ConfigError(f"{idx_path(prefix)}: missing index file (the .bin exists)")
    if not has_bin:
        raise ConfigError(f"{bin_path(prefix)}: missing token file (the .idx exists)")


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))
