"""Blended datasets: exact mixture at every prefix, Megatron's --data-path forms, per-split blends."""
import numpy as np
import pytest

from megatron_lite.config import DataConfig
from megatron_lite.data import build_tokenizer, build_train_valid_test_datasets
from megatron_lite.data.blended_dataset import BlendedDataset, blending_indices, samples_per_dataset
from megatron_lite.data.builder import parse_data_path
from megatron_lite.data.indexed_dataset import IndexedDatasetWriter


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.5, 0.3, 0.15, 0.05], [0.01, 0.99],
                                     list(np.random.default_rng(0).random(7) ** 3)])
def test_prefix_counts_within_one_sample(weights):
    w = np.asarray(weights, float) / np.sum(weights)
    size = 5000
    idx = blending_indices(w, size)
    counts = np.cumsum(np.eye(len(w), dtype=np.int64)[idx["dataset_index"]], axis=0)
    n = np.arange(1, size + 1)[:, None]
    assert np.abs(counts - w[None, :] * n).max() < 1
    for d in range(len(w)):  # each dataset's samples are drawn in order 0, 1, 2, ...
        assert idx["dataset_sample_index"][idx["dataset_index"] == d].tolist() == list(range(counts[-1, d]))
    assert all(c <= s for c, s in zip(counts[-1], samples_per_dataset(weights, size)))


def test_random_weight_vectors_keep_the_bound():
    rng = np.random.default_rng(1)
    for _ in range(30):
        w = rng.random(rng.integers(2, 9)) ** 4
        w /= w.sum()
        idx = blending_indices(w, 800)["dataset_index"]
        counts = np.cumsum(np.eye(len(w))[idx], axis=0)
        assert np.abs(counts - np.arange(1, 801)[:, None] * w).max() < 1


class _Tagged:
    def __init__(self, tag, n):
        self.tag, self.n = tag, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (self.tag, i)


def test_blended_dataset_serves_from_members(tmp_path):
    b = BlendedDataset([_Tagged("a", 80), _Tagged("b", 30)], [0.7, 0.3], 100, str(tmp_path), {"t": 1})
    items = [b[i] for i in range(len(b))]
    assert sum(1 for t, _ in items if t == "a") == 70 and items[0] == ("a", 0)
    assert BlendedDataset([_Tagged("a", 80), _Tagged("b", 30)], [0.7, 0.3], 100, str(tmp_path),
                          {"t": 1}).built_indices is False
    with pytest.raises(ValueError, match="samples"):
        BlendedDataset([_Tagged("a", 10), _Tagged("b", 30)], [0.7, 0.3], 100, None, {})


def test_parse_data_path():
    assert parse_data_path(["/d/web"]) == [(None, "/d/web")]
    assert parse_data_path(["0.7", "/d/web", "0.3", "/d/code"]) == [(0.7, "/d/web"), (0.3, "/d/code")]
    assert parse_data_path(["0.7 /d/web 0.3 /d/code"]) == [(0.7, "/d/web"), (0.3, "/d/code")]
    assert parse_data_path(["/d/a", "/d/b"]) == [(None, "/d/a"), (None, "/d/b")]


def _corpus(prefix, value, n_docs):
    w = IndexedDatasetWriter(str(prefix), np.uint16)
    for i in range(n_docs):
        w.add_document(np.full(20 + i % 7, value))
    w.finalize()
    return str(prefix)


def test_megatron_style_data_path_blends_each_split(tmp_path):
    web, code = _corpus(tmp_path / "web_text_document", 1, 300), _corpus(tmp_path / "code_text_document", 2, 200)
    cfg = DataConfig(data_path=["0.7", web, "0.3", code], split="90,10,0", data_cache_path=str(tmp_path / "c"))
    tok = build_tokenizer("ByteTokenizer")
    train, valid, test = build_train_valid_test_datasets(cfg, tok, 16, 1, (1000, 100, 0))
    assert test is None and len(train) == 1000 and len(valid) == 100
    for ds, n in ((train, 1000), (valid, 100)):
        src = np.array([int(ds[i]["tokens"][0]) for i in range(n)])
        assert abs((src == 1).sum() - 0.7 * n) < 1 and set(src.tolist()) == {1, 2}
    assert set(train.datasets[0].document_index.tolist()) <= set(range(270))
    assert set(valid.datasets[1].document_index.tolist()) <= set(range(180, 200))
    again, *_ = build_train_valid_test_datasets(cfg, tok, 16, 1, (1000, 100, 0))
    assert not again.built_indices and np.array_equal(again.dataset_index, train.dataset_index)


def test_unweighted_prefixes_blend_by_size(tmp_path):
    a, b = _corpus(tmp_path / "a", 1, 300), _corpus(tmp_path / "b", 2, 100)
    cfg = DataConfig(data_path=[a, b], split="1,0,0", data_cache_path=str(tmp_path / "c"))
    train, _, _ = build_train_valid_test_datasets(cfg, build_tokenizer("ByteTokenizer"), 16, 1, (400, 0, 0))
    assert train.weights == pytest.approx([0.75, 0.25], abs=0.01)
