"""The .bin/.idx format, checked against an independent struct-based implementation of the spec
(NOTES.md), in both directions and byte for byte."""
import struct

import numpy as np
import pytest

from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, optimal_dtype, write_index

# --- an independent implementation, written from the spec only -------------------------------
CODES = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 6: "d", 7: "f", 8: "H"}  # struct format letters


def spec_write(prefix, documents, code):
    """documents: list of documents, each a list of sequences (lists of ints)."""
    fmt = CODES[code]
    size = struct.calcsize(fmt)
    lengths, pointers, doc_idx, offset = [], [], [0], 0
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            for seq in doc:
                f.write(struct.pack(f"<{len(seq)}{fmt}", *seq))
                lengths.append(len(seq))
                pointers.append(offset)
                offset += len(seq) * size
            doc_idx.append(len(lengths))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def spec_read(prefix):
    """-> (code, list of sequences, document indices)"""
    with open(prefix + ".idx", "rb") as f:
        data = f.read()
    assert data[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", data, 9)
    assert version == 1
    (code,) = struct.unpack_from("<B", data, 17)
    n_seq, n_doc = struct.unpack_from("<QQ", data, 18)
    off = 34
    lengths = struct.unpack_from(f"<{n_seq}i", data, off)
    off += 4 * n_seq
    pointers = struct.unpack_from(f"<{n_seq}q", data, off)
    off += 8 * n_seq
    doc_idx = struct.unpack_from(f"<{n_doc}q", data, off)
    with open(prefix + ".bin", "rb") as f:
        blob = f.read()
    fmt = CODES[code]
    seqs = [list(struct.unpack_from(f"<{n}{fmt}", blob, p)) for n, p in zip(lengths, pointers)]
    return code, seqs, list(doc_idx)
# ----------------------------------------------------------------------------------------------


def random_documents(rng, n_docs, vocab, max_sents=3, max_len=40):
    return [[rng.integers(0, vocab, rng.integers(1, max_len)).tolist() for _ in range(rng.integers(1, max_sents + 1))]
            for _ in range(n_docs)]


@pytest.mark.parametrize("dtype,code,vocab", [(np.uint16, 8, 257), (np.int32, 4, 100_000), (np.uint8, 1, 200),
                                              (np.int64, 5, 1000)])
def test_our_writer_matches_spec_byte_for_byte(tmp_path, dtype, code, vocab):
    rng = np.random.default_rng(0)
    docs = random_documents(rng, 50, vocab)
    ours = IndexedDatasetWriter(str(tmp_path / "ours"), dtype)
    for doc in docs:
        ours.add_document(np.concatenate([np.asarray(s) for s in doc]), [len(s) for s in doc])
    ours.finalize()
    spec_write(str(tmp_path / "spec"), docs, code)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"spec{ext}").read_bytes()
    code_read, seqs, doc_idx = spec_read(str(tmp_path / "ours"))
    assert code_read == code and seqs == [s for d in docs for s in d]


@pytest.mark.parametrize("code", [1, 3, 4, 5, 8])
def test_reader_loads_spec_files(tmp_path, code):
    rng = np.random.default_rng(code)
    docs = random_documents(rng, 30, 120)
    spec_write(str(tmp_path / "spec"), docs, code)
    ds = IndexedDataset(str(tmp_path / "spec"))
    seqs = [s for d in docs for s in d]
    assert len(ds) == len(seqs) and ds.num_documents == len(docs)
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
    assert ds.get(3, offset=1, length=2).tolist() == seqs[3][1:3]
    ends = np.cumsum([len(d) for d in docs]).tolist()
    assert ds.document_indices.tolist() == [0] + ends
    assert ds.document(4).tolist() == [t for s in docs[4] for t in s]


def test_empty_dataset_round_trips(tmp_path):
    w = IndexedDatasetWriter(str(tmp_path / "e"), np.uint16)
    w.finalize()
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0
    assert spec_read(str(tmp_path / "e")) == (8, [], [0])


def test_reader_does_not_read_the_bin(tmp_path):
    """Opening memory-maps: a 40 MB .bin opens in far less time than it takes to read it."""
    n = 20_000_000
    write_index(str(tmp_path / "big.idx"), np.uint16, np.full(1000, n // 1000), np.arange(1001))
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(n * 2)  # sparse: reading it would be noticed only as time
    ds = IndexedDataset(str(tmp_path / "big"))
    assert ds.num_tokens == n and ds.get(999, 5, 3).tolist() == [0, 0, 0]
    assert isinstance(ds.tokens, np.memmap)


def test_optimal_dtype():
    assert optimal_dtype(257) == np.uint16 and optimal_dtype(65536) == np.uint16
    assert optimal_dtype(65537) == np.int32 and optimal_dtype(128_256) == np.int32
