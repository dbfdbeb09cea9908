"""GPT samples, splits, index caching, item fields, mock data and the built-in corpus."""
import multiprocessing
import os
import time

import numpy as np
import pytest
import torch

from megatron_lite.config import DataConfig
from megatron_lite.data import build_tokenizer, build_train_valid_test_datasets
from megatron_lite.data.builder import parse_split, split_ranges
from megatron_lite.data.gpt_dataset import GPTDataset, SampleOptions, build_indices, make_item
from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter

EOD = 256


def write_corpus(prefix, n_docs=200, seed=0, max_len=60):
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(0, 256, rng.integers(1, max_len)), EOD) for _ in range(n_docs)]
    w = IndexedDatasetWriter(str(prefix), np.uint16)
    for d in docs:
        w.add_document(d)
    w.finalize()
    return str(prefix), docs


def stream(ds, document_index):
    return np.concatenate([ds[int(i)] for i in document_index]).astype(np.int64)


def test_samples_are_contiguous_windows_over_shuffled_documents(tmp_path):
    prefix, docs = write_corpus(tmp_path / "c")
    ix = IndexedDataset(prefix)
    seq = 16
    d = GPTDataset(ix, (0, len(ix)), 10, seq, 7, SampleOptions(EOD), None)
    total = sum(len(x) for x in docs)
    assert sorted(d.document_index.tolist()) == list(range(len(docs)))  # one epoch: each doc once
    assert len(d) == (total - 1) // seq >= 10
    s = stream(ix, d.document_index)
    for i in range(len(d)):
        j = int(d.shuffle_index[i])
        assert np.array_equal(d.sample_tokens(i), s[j * seq:j * seq + seq + 1])
    assert sorted(d.shuffle_index.tolist()) == list(range(len(d)))
    used = np.zeros(total, bool)  # every token of the epoch is used, up to the last full window
    for j in range(len(d)):
        used[j * seq:j * seq + seq + 1] = True
    assert used[:len(d) * seq + 1].all() and total - used.sum() < seq
    item = d[3]
    assert torch.equal(item["tokens"][1:], item["labels"][:-1]) and item["tokens"].dtype == torch.int64


def test_epochs_repeat_until_enough_samples():
    sizes = np.array([5, 9, 3, 7])  # 24 tokens per epoch
    idx = build_indices(sizes, seq_length=4, num_samples=36, seed=1)
    doc = idx["document_index"]
    epochs = len(doc) // 4
    assert epochs == 7 and all(sorted(doc[e * 4:(e + 1) * 4]) == [0, 1, 2, 3] for e in range(epochs))
    n = len(idx["shuffle_index"])
    assert n == (epochs * 24 - 1) // 4 >= 36
    # the last epoch is needed in small part, so its samples are shuffled on their own (as Megatron)
    before_last = (6 * 24 - 1) // 4
    assert sorted(idx["shuffle_index"][:before_last]) == list(range(before_last))


def test_index_build_for_a_million_documents_is_fast():
    sizes = np.random.default_rng(0).integers(1, 1000, 1_000_000)
    t = time.perf_counter()
    idx = build_indices(sizes, 1024, 500_000, 1234)
    assert time.perf_counter() - t < 10 and len(idx["shuffle_index"]) >= 500_000


def test_split_ranges():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(10, parse_split("1,1,1")) == [(0, 4), (4, 7), (7, 10)]  # Megatron's rounding
    assert split_ranges(5, parse_split("100,0,0")) == [(0, 5), (5, 5), (5, 5)]


def test_splits_use_disjoint_document_ranges(tmp_path):
    prefix, _ = write_corpus(tmp_path / "c", n_docs=100)
    cfg = DataConfig(data_path=[prefix], split="80,15,5", data_cache_path=str(tmp_path / "cache"))
    tok = build_tokenizer("ByteTokenizer")
    train, valid, test = build_train_valid_test_datasets(cfg, tok, 8, 1, (50, 10, 5))
    assert set(train.document_index.tolist()) == set(range(80))
    assert set(valid.document_index.tolist()) == set(range(80, 95))
    assert set(test.document_index.tolist()) == set(range(95, 100))
    assert len(train) >= 50 and len(valid) >= 10 and len(test) >= 5
    cfg.split = "100,0,0"
    train, valid, test = build_train_valid_test_datasets(cfg, tok, 8, 1, (50, 0, 0))
    assert valid is None and test is None


def test_index_cache_reused_and_invalidated(tmp_path):
    prefix, _ = write_corpus(tmp_path / "c")
    ix = IndexedDataset(prefix)
    cache = str(tmp_path / "cache")

    def build(seed=1, num_samples=20):
        return GPTDataset(IndexedDataset(prefix), (0, len(ix)), num_samples, 16, seed, SampleOptions(EOD), cache)

    first = build()
    assert first.built_indices
    files = sorted(os.listdir(cache))
    assert len([f for f in files if f.endswith(".npy")]) == 3 and not [f for f in files if ".tmp" in f]
    second = build()
    assert not second.built_indices and np.array_equal(first.shuffle_index, second.shuffle_index)
    assert build(seed=2).built_indices and build(num_samples=21).built_indices
    st = os.stat(prefix + ".bin")
    os.utime(prefix + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "touch"
    third = build()
    assert third.built_indices and not build().built_indices


def test_cache_defaults_next_to_the_data(tmp_path):
    prefix, _ = write_corpus(tmp_path / "c")
    cfg = DataConfig(data_path=[prefix], split="1,0,0")
    build_train_valid_test_datasets(cfg, build_tokenizer("ByteTokenizer"), 8, 1, (10, 0, 0))
    assert any(f.endswith("shuffle_index.npy") for f in os.listdir(tmp_path / "cache" / "GPTDataset_indices"))


def _build_in_child(args):
    prefix, cache = args
    ix = IndexedDataset(prefix)
    d = GPTDataset(ix, (0, len(ix)), 5000, 8, 3, SampleOptions(EOD), cache)
    return np.asarray(d.shuffle_index).sum(), np.asarray(d.sample_index).sum()


def test_concurrent_ranks_build_the_same_cache(tmp_path):
    prefix, _ = write_corpus(tmp_path / "c", n_docs=2000)
    cache = str(tmp_path / "cache")
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.map(_build_in_child, [(prefix, cache)] * 4)
    assert len(set(results)) == 1
    assert not [f for f in os.listdir(cache) if ".tmp" in f]
    assert _build_in_child((prefix, cache)) == results[0]


def test_item_flags():
    sample = np.array([5, 6, EOD, 7, 8, EOD, 9, 10, 11])
    item = make_item(sample, SampleOptions(EOD))
    assert item["position_ids"].tolist() == list(range(8)) and "document_ids" not in item
    assert item["loss_mask"].tolist() == [1.0] * 8 and item["loss_mask"].dtype == torch.float32
    item = make_item(sample, SampleOptions(EOD, reset_position_ids=True, reset_attention_mask=True,
                                           eod_mask_loss=True))
    assert item["tokens"].tolist() == [5, 6, EOD, 7, 8, EOD, 9, 10]
    assert item["labels"].tolist() == [6, EOD, 7, 8, EOD, 9, 10, 11]
    assert item["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert item["loss_mask"].tolist() == [1, 1, 0, 1, 1, 0, 1, 1]
    assert item["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]  # the EOD belongs to the one it ends


def test_mock_data_is_deterministic():
    tok = build_tokenizer("NullTokenizer", vocab_size=50)
    cfg = DataConfig(mock_data=True)
    a = build_train_valid_test_datasets(cfg, tok, 32, 5, (100, 10, 1))
    b = build_train_valid_test_datasets(cfg, tok, 32, 5, (100, 10, 1))
    c = build_train_valid_test_datasets(cfg, tok, 32, 6, (100, 10, 1))
    assert [len(x) for x in a] == [100, 10, 1]
    assert torch.equal(a[0][7]["tokens"], b[0][7]["tokens"]) and not torch.equal(a[0][7]["tokens"], c[0][7]["tokens"])
    assert not torch.equal(a[0][0]["tokens"], a[1][0]["tokens"])
    t = torch.stack([a[0][i]["tokens"] for i in range(100)])
    assert t.min() >= 0 and t.max() < tok.vocab_size and t.shape == (100, 32)


def test_default_corpus_is_the_stdlib(tmp_path):
    cfg = DataConfig(data_cache_path=str(tmp_path))
    tok = build_tokenizer("ByteTokenizer")
    t = time.perf_counter()
    train, valid, test = build_train_valid_test_datasets(cfg, tok, 64, 1234, (1000, 100, 10))
    assert time.perf_counter() - t < 30
    assert len(train) >= 1000 and len(valid) >= 100 and len(test) >= 10
    corpus = [f for f in os.listdir(tmp_path / "default_corpus") if f.endswith(".bin")]
    assert len(corpus) == 1
    mtime = os.path.getmtime(tmp_path / "default_corpus" / corpus[0])
    train2, *_ = build_train_valid_test_datasets(cfg, tok, 64, 1234, (1000, 100, 10))
    assert os.path.getmtime(tmp_path / "default_corpus" / corpus[0]) == mtime and not train2.built_indices
    text = tok.detokenize(train[0]["tokens"].tolist())
    assert len(text) > 10 and torch.equal(train[5]["tokens"], train2[5]["tokens"])
    ix = IndexedDataset(str(tmp_path / "default_corpus" / corpus[0])[:-4])
    assert 10 << 20 < ix.num_tokens <= 21 << 20 and "def " in tok.detokenize(ix.document(0).tolist())


def test_replaced_corpus_with_same_sizes_and_mtimes_rebuilds_its_indices(tmp_path):
    """`cp -p`, `rsync -a` and `tar x` keep sizes and mtimes: the cache must see the new content."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 60, 120)
    docs_a = [np.append(rng.integers(0, 256, n), EOD) for n in lengths]
    docs_b = [np.append(rng.integers(0, 256, n), EOD) for n in lengths[::-1]]  # same sizes, other order
    paths = {}
    for name, docs in (("a", docs_a), ("b", docs_b)):
        w = IndexedDatasetWriter(str(tmp_path / name), np.uint16)
        for d in docs:
            w.add_document(d)
        w.finalize()
        paths[name] = str(tmp_path / name)
    cache, seq = str(tmp_path / "cache"), 16
    first = GPTDataset(IndexedDataset(paths["a"]), (0, len(docs_a)), 20, seq, 7, SampleOptions(EOD), cache)
    assert first.built_indices
    stamps = {ext: os.stat(paths["a"] + ext) for ext in (".idx", ".bin")}
    for ext, st in stamps.items():  # b's files under a's names, with a's sizes and times
        os.replace(paths["b"] + ext, paths["a"] + ext)
        assert os.path.getsize(paths["a"] + ext) == st.st_size
        os.utime(paths["a"] + ext, ns=(st.st_atime_ns, st.st_mtime_ns))
    ix = IndexedDataset(paths["a"])
    again = GPTDataset(ix, (0, len(docs_b)), 20, seq, 7, SampleOptions(EOD), cache)
    assert again.built_indices, "the stale index of the old corpus was reused"
    s = stream(ix, again.document_index)
    for i in range(len(again)):
        j = int(again.shuffle_index[i])
        assert np.array_equal(again.sample_tokens(i), s[j * seq:j * seq + seq + 1])


def test_reads_past_a_sequence_are_refused(tmp_path):
    prefix, docs = write_corpus(tmp_path / "c", n_docs=3)
    ix = IndexedDataset(prefix)
    assert np.array_equal(ix.get(1, 1, 2), docs[1][1:3])
    for bad in ((1, 0, len(docs[1]) + 1), (3, 0, 1), (0, -1, 1)):
        with pytest.raises(IndexError, match="sequence"):
            ix.get(*bad)
