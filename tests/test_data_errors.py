"""Every bad input is a one-line ConfigError naming the file and the problem, before training."""
import os
import struct

import numpy as np
import pytest

from megatron_lite.config import DataConfig
from megatron_lite.errors import ConfigError
from megatron_lite.data import build_tokenizer, build_train_valid_test_datasets
from megatron_lite.data.indexed_dataset import IndexedDatasetWriter


def corpus(tmp_path, name="c", dtype=np.uint16, tokens=range(10, 50)):
    w = IndexedDatasetWriter(str(tmp_path / name), dtype)
    for i in range(20):
        w.add_document(np.asarray(list(tokens)) + 0 * i)
    w.finalize()
    return str(tmp_path / name)


def build(tmp_path, data_path, tokenizer=None, split="1,0,0"):
    cfg = DataConfig(data_path=list(data_path), split=split, data_cache_path=str(tmp_path / "cache"))
    return build_train_valid_test_datasets(cfg, tokenizer or build_tokenizer("ByteTokenizer"), 8, 1, (10, 0, 0))


def expect(tmp_path, data_path, *fragments, tokenizer=None, split="1,0,0"):
    with pytest.raises(ConfigError) as e:
        build(tmp_path, data_path, tokenizer, split)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


def patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_good_corpus_builds(tmp_path):
    train, _, _ = build(tmp_path, [corpus(tmp_path)])
    assert len(train) >= 10


def test_path_that_does_not_exist(tmp_path):
    expect(tmp_path, [str(tmp_path / "nothing")], str(tmp_path / "nothing"), "no such dataset")
    p = corpus(tmp_path)
    expect(tmp_path, [p + ".bin"], "give the prefix without .bin/.idx")


def test_missing_idx_or_bin(tmp_path):
    p = corpus(tmp_path)
    os.remove(p + ".idx")
    expect(tmp_path, [p], p + ".idx", "missing index")
    p = corpus(tmp_path, "d")
    os.remove(p + ".bin")
    expect(tmp_path, [p], p + ".bin", "missing token file")


def test_truncated_bin(tmp_path):
    p = corpus(tmp_path)
    with open(p + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(p + ".bin") - 10)
    expect(tmp_path, [p], p + ".bin", "truncated")


def test_wrong_magic_version_dtype_and_truncated_index(tmp_path):
    p = corpus(tmp_path, "magic")
    patch(p + ".idx", 0, b"NOTMAGIC!")
    expect(tmp_path, [p], p + ".idx", "wrong magic")
    p = corpus(tmp_path, "version")
    patch(p + ".idx", 9, struct.pack("<Q", 2))
    expect(tmp_path, [p], p + ".idx", "version 2")
    p = corpus(tmp_path, "code")
    patch(p + ".idx", 17, struct.pack("<B", 42))
    expect(tmp_path, [p], p + ".idx", "dtype code 42")
    p = corpus(tmp_path, "short")
    with open(p + ".idx", "r+b") as f:
        f.truncate(50)
    expect(tmp_path, [p], p + ".idx", "truncated index")
    p = corpus(tmp_path, "empty")
    open(p + ".idx", "wb").close()
    expect(tmp_path, [p], p + ".idx", "wrong magic")


def test_dtype_that_disagrees_with_the_vocab(tmp_path):
    p = corpus(tmp_path, "small")  # uint16
    big = build_tokenizer("NullTokenizer", vocab_size=100_000)
    expect(tmp_path, [p], p + ".idx", "uint16", "100001", tokenizer=big)
    p = corpus(tmp_path, "big", dtype=np.int32, tokens=range(250, 300))
    expect(tmp_path, [p], p + ".bin", "token id 299", "vocab [0, 257)")
    p = corpus(tmp_path, "float", dtype=np.float32)
    expect(tmp_path, [p], p + ".idx", "not an integer")


def test_bad_data_path_lists(tmp_path):
    p = corpus(tmp_path)
    expect(tmp_path, ["0.7", p, "0.3"], "--data-path", "pairs", "3 items")
    expect(tmp_path, ["0.7", p, "x", p], "--data-path", "weight")
    expect(tmp_path, ["-1", p, "1", p], "non-negative")
    expect(tmp_path, ["0.5", p, "0.5", str(tmp_path / "gone")], str(tmp_path / "gone"), "no such dataset")


def test_bad_split(tmp_path):
    expect(tmp_path, [corpus(tmp_path)], "--split", split="a,b")
    expect(tmp_path, [corpus(tmp_path)], "--split", split="1,2,3,4")


def test_a_bin_swapped_with_the_same_size_and_mtime_is_checked_again(tmp_path):
    """Issue 26: the cached token range outlived a .bin replaced by one of the same size and mtime
    whose ids exceed the vocabulary (an IndexError in the embedding later)."""
    p = corpus(tmp_path, "swap", dtype=np.int32, tokens=range(10, 50))
    build(tmp_path, [p])  # the token range [10, 49] is cached
    st = os.stat(p + ".bin")
    bad = np.fromfile(p + ".bin", dtype=np.int32)
    bad[-1] = 300
    bad.tofile(p + ".bin.new")
    os.replace(p + ".bin.new", p + ".bin")
    os.utime(p + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(p + ".bin").st_size == st.st_size and os.stat(p + ".bin").st_mtime_ns == st.st_mtime_ns
    expect(tmp_path, [p], p + ".bin", "token id 300", "vocab [0, 257)")
