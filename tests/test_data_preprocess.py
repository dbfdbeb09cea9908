"""tools/preprocess_data.py and tools/train_tokenizer.py: round trips, bad lines, the CLI."""
import json
import os
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from megatron_lite.errors import ConfigError
from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.data.tokenizers import build_tokenizer
from tools import preprocess_data, train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sample_texts(n=60):
    """Real, varied text: stdlib sources, plus unicode, whitespace runs and tabs."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(f for f in os.listdir(root) if f.endswith(".py"))[:n]
    texts = [open(os.path.join(root, f), encoding="utf-8").read()[:3000] for f in names]
    texts += ["ünïcödé 日本語 😀  two  spaces\n\ttab", " leading space. Second sentence!  Third?", "x"]
    return texts


def write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    corpus = write_jsonl(d / "train.jsonl", [{"text": t} for t in sample_texts()])
    return train_tokenizer.train([corpus], str(d / "tok"), vocab_size=1000)


def preprocess(tmp_path, texts, *extra):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    prefix = str(tmp_path / "out")
    assert preprocess_data.main(["--input", inp, "--output-prefix", prefix, "--quiet", *extra]) == 0
    return prefix + "_text_document"


@pytest.mark.parametrize("kind", ["ByteTokenizer", "SentencePieceTokenizer"])
def test_round_trip(tmp_path, sp_model, kind):
    texts = sample_texts()
    tok = build_tokenizer(kind, tokenizer_model=sp_model)
    ds = IndexedDataset(preprocess(tmp_path, texts, "--append-eod", "--tokenizer-type", kind,
                                   "--tokenizer-model", sp_model))
    assert ds.num_documents == len(texts) and ds.dtype == np.uint16
    for i, text in enumerate(texts):
        ids = ds.document(i).tolist()
        assert ids == tok.tokenize(text) + [tok.eod]
        assert tok.detokenize(ids[:-1]) == text  # the trained model loses nothing


def test_without_eod_and_with_sentences(tmp_path):
    texts = ["One. Two!  Three?\nFour", "Single"]
    ds = IndexedDataset(preprocess(tmp_path, texts))
    assert [ds.document(i).tobytes() for i in range(2)] == [b"".join(
        np.array(list(t.encode()), np.uint16).tobytes() for t in [x]) for x in texts]
    inp = write_jsonl(tmp_path / "s.jsonl", [{"text": t} for t in texts])
    preprocess_data.main(["--input", inp, "--output-prefix", str(tmp_path / "s"), "--split-sentences",
                          "--append-eod", "--quiet"])
    ds = IndexedDataset(str(tmp_path / "s_text_sentence"))
    assert ds.document_indices.tolist() == [0, 4, 5]
    sents = [bytes(ds[i][ds[i] < 256].astype(np.uint8)).decode() for i in range(4)]
    assert sents == ["One. ", "Two!  ", "Three?\n", "Four"] and ds[3][-1] == 256


def test_bad_lines_are_skipped_and_counted(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": "good"}, "{not json", {"title": "no text"}, {"text": ""},
                                              {"text": 7}, "", "[1, 2]", {"text": "also good"}])
    prefix = str(tmp_path / "out")
    assert preprocess_data.main(["--input", inp, "--output-prefix", prefix, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "2 documents" in out and "skipped: 6" in out
    for reason in ("malformed JSON: 2", "missing key 'text': 1", "empty document ('text'): 1",
                   "'text' is not a string: 1", "blank line: 1", "first at line 2"):
        assert reason in out
    ds = IndexedDataset(prefix + "_text_document")
    assert [bytes(ds.document(i).astype(np.uint8)) for i in range(2)] == [b"good", b"also good"]


@pytest.mark.parametrize("bad,reason", [("{oops", "malformed JSON"), ('{"title": 1}', "missing key 'text'"),
                                        ('{"text": ""}', "empty document")])
def test_strict_names_the_line(tmp_path, capsys, bad, reason):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}, {"text": "fine"}, bad, {"text": "fine"}])
    prefix = str(tmp_path / "out")
    assert preprocess_data.main(["--input", inp, "--output-prefix", prefix, "--strict", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"in.jsonl:3: {reason}" in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(prefix + "_text_document.idx")  # nothing half-written is left
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_multiple_keys_and_missing_input(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc", "title": "T"}, {"text": "de"}])
    preprocess_data.main(["--input", inp, "--output-prefix", str(tmp_path / "o"), "--json-keys", "text", "title",
                          "--quiet"])
    assert IndexedDataset(str(tmp_path / "o_text_document")).num_documents == 2
    assert IndexedDataset(str(tmp_path / "o_title_document")).num_documents == 1
    with pytest.raises(ConfigError, match="no such file"):
        preprocess_data.run(preprocess_data.get_args(["--input", str(tmp_path / "nope.jsonl"),
                                                      "--output-prefix", str(tmp_path / "x")]))


def test_large_vocab_uses_int32(tmp_path):
    ds = IndexedDataset(preprocess(tmp_path, ["1 70000 5", "69999"], "--tokenizer-type", "NullTokenizer",
                                   "--vocab-size", "70001", "--append-eod"))
    assert ds.dtype == np.int32 and ds.document(0).tolist() == [1, 70000, 5, 70001]


def test_cli_with_two_workers(tmp_path):
    """End to end through a subprocess: several chunks, two worker processes, order preserved."""
    records = [{"text": f"document {i} " + "lorem ipsum " * (i % 50)} for i in range(12000)]
    records[1234] = "{broken"
    inp = write_jsonl(tmp_path / "in.jsonl", records)
    assert os.path.getsize(inp) > 3 * preprocess_data.CHUNK_BYTES  # several chunks per worker
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", inp,
           "--output-prefix", str(tmp_path / "corpus"), "--workers", "2", "--append-eod"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "11999 documents" in res.stdout and "2 workers" in res.stdout
    assert "skipped: 1 (malformed JSON: 1); first at line 1235" in res.stdout
    ds = IndexedDataset(str(tmp_path / "corpus_text_document"))
    good = [r["text"] for r in records if isinstance(r, dict)]
    assert ds.num_documents == len(good) and ds.num_tokens == sum(len(t) + 1 for t in good)
    for i in (0, 1233, 1234, 11998):
        assert bytes(ds.document(i)[:-1].astype(np.uint8)).decode() == good[i]


def test_invalid_unicode_is_skipped_and_counted(tmp_path):
    """Valid JSON can still hold a lone surrogate ("\\ud800"), which UTF-8 cannot encode."""
    src = tmp_path / "s.jsonl"
    src.write_text('{"text": "fine"}\n{"text": "bad \\ud800 text"}\n{"text": "also fine"}\n')
    stats = preprocess_data.run(preprocess_data.get_args(["--input", str(src), "--output-prefix",
                                                          str(tmp_path / "s"), "--append-eod"]))
    assert stats["skipped"] == {"'text' is not valid Unicode": 1}
    ds = IndexedDataset(str(tmp_path / "s_text_document"))
    assert len(ds) == 2 and bytes(ds.document(1)[:-1].tolist()).decode() == "also fine"


def test_a_key_no_line_has_is_an_error_and_writes_nothing(tmp_path, capsys):
    """Issue 26: --json-keys content on lines that only have 'text' wrote an empty dataset, exit 0."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}, {"text": "b"}])
    out = tmp_path / "out"
    argv = ["--input", inp, "--output-prefix", str(out / "ds"), "--quiet", "--json-keys", "content"]
    assert preprocess_data.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"preprocess_data: error: --json-keys content: no line of {inp} gives a document for it "
                   f"(missing key 'content': 2); nothing written: name a key the lines have"), err
    assert not out.exists() or os.listdir(out) == []


def test_an_unwritable_output_prefix_is_one_line(tmp_path, capsys):
    """Issue 39: --output-prefix under /proc was an OSError traceback."""
    inp = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    assert preprocess_data.main(["--input", inp, "--output-prefix", "/proc/x/y", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("preprocess_data: error: --output-prefix /proc/x/y: cannot write there (") and \
        err.endswith("give a writable location") and "\n" not in err, err
