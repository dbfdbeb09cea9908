"""Generation with a KV cache, and the generate / evaluate tools.

Oracles: Hugging Face `generate(do_sample=False)` (and its raw logits) on the random tiny models of
every family that test_hf_parity.py builds, converted to ours; HF's logits warpers for temperature / top-k / top-p; for the KV
cache, our own model recomputing every step's logits from the whole unpadded sequence; for the
tools, a model loaded from the checkpoint and the training run's own validation loss.
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_lite.errors import ConfigError  # noqa: E402
from megatron_lite.inference import DecodingSession, SamplingParams, filter_logits, generate  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402
from models.gpt import build_model  # noqa: E402
from models.hf_conversion import (hf_config_to_model_config, hf_to_megatron_lite,  # noqa: E402
                                  load_full_state_dict_into_model)
from test_hf_parity import MOE, NAMES, VOCAB, hf_model  # noqa: E402  (the tiny HF models of every family)
from training_utils import LLAMA_SWITCHES, TINY, train_in_process  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import convert_checkpoint  # noqa: E402,F401  (imported here, while tools/ is on the path)
import evaluate as evaluate_tool  # noqa: E402
import generate as generate_tool  # noqa: E402

sys.path.pop(0)

PROMPTS = [[3, 17, 42, 5, 8, 60, 1], [99, 0, 12], [7, 7, 31, 64, 2]]  # unequal lengths: left padding
NEW = 32
FAMILIES = NAMES  # every family test_hf_parity builds: GPT-2, Llama (3 kinds), Mistral, Qwen2/3, 8 MoE (2 with MLA; gpt-oss)
DENSE = [n for n in NAMES if n not in MOE]  # MoE models generate at TP 1 only


@functools.lru_cache(maxsize=None)
def hf_greedy(name: str):
    """Per prompt: (HF's 32 greedy tokens, the log-probability of each under HF's raw logits)."""
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        res = hf_model(name).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        tokens = res.sequences[0, len(prompt):]
        logprobs = torch.stack([lg[0].float().log_softmax(-1)[t] for lg, t in zip(res.logits, tokens)])
        out.append((tokens.tolist(), logprobs))
    return out


def converted(name: str):
    hf = hf_model(name)
    cfg = hf_config_to_model_config(hf.config)
    return cfg, hf_to_megatron_lite(hf.state_dict(), cfg)


def our_model(cfg, state, tp: int = 1):
    dims = ParallelDims.from_world(tp=tp)
    model = build_model(cfg, dims, seed=7)[0].eval()
    load_full_state_dict_into_model(model, state, dims)
    return model


# --- generation against HF and against recomputation --------------------------------------------
def _recomputation_gap(model, prompts=PROMPTS, steps: int = 16) -> float:
    """Greedy-decode `prompts` as one batch (left-padded when their lengths differ); at every
    step, the largest difference between the cached logits of each sequence and a full forward
    of that sequence alone."""
    session = DecodingSession(model, prompts, steps)
    logits, seqs, gap = session.prefill(), [list(p) for p in prompts], 0.0
    for _ in range(steps):
        with torch.no_grad():
            full = torch.stack([model(torch.tensor([s]))[0, -1] for s in seqs])
        gap = max(gap, (logits - full).abs().max().item())
        tokens = logits.argmax(-1)
        for s, t in zip(seqs, tokens.tolist()):
            s.append(t)
        logits = session.step(tokens)
    return gap


def _generation_worker(rank, world, cfg, state, with_sampling):
    model = our_model(cfg, state, tp=world)
    out = dict(batched=generate(model, PROMPTS, NEW), single=[generate(model, [p], NEW)[0] for p in PROMPTS])
    # Unequal lengths: the padding mask at every step; equal ones: no mask (the decoding fast path).
    out["gap"] = max(_recomputation_gap(model), _recomputation_gap(model, [PROMPTS[0], PROMPTS[0][::-1]]))
    if with_sampling:
        sampling = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=5)
        out["sampled"] = [generate(model, PROMPTS, 16, sampling) for _ in range(2)]
        out["other_seed"] = generate(model, PROMPTS, 16, SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=6))
    return out


SAMPLED = ["gpt2", "llama_gqa", "qwen3"]


@functools.lru_cache(maxsize=None)
def generation_results(name: str, tp: int):
    return run_distributed(_generation_worker, tp, *converted(name), name in SAMPLED)


TP2_DEFAULT = ["llama_gqa", "qwen3"]  # the other dense families at TP2 run with -m slow (~4 s each)
LAYOUTS = [(name, 1) for name in FAMILIES] + [(name, 2) if name in TP2_DEFAULT else
                                              pytest.param(name, 2, marks=pytest.mark.slow) for name in DENSE]


@pytest.mark.parametrize("name,tp", LAYOUTS)
def test_greedy_generation_matches_hf(name, tp):
    """32 greedy tokens equal HF generate's, batched (left-padded) and one prompt at a time, and
    their log-probabilities equal HF's raw logits'."""
    for rank, res in enumerate(generation_results(name, tp)):
        for i, (hf_tokens, hf_logprobs) in enumerate(hf_greedy(name)):
            for how in ("batched", "single"):
                got = res[how][i]
                assert got.tokens == hf_tokens, f"rank {rank}, prompt {i}, {how}"
                assert torch.allclose(torch.tensor(got.logprobs), hf_logprobs, atol=1e-4), f"rank {rank}, prompt {i}"
            batched, single = res["batched"][i].logprobs, res["single"][i].logprobs
            assert max(abs(a - b) for a, b in zip(batched, single)) < 1e-5, "batched vs one by one"


@pytest.mark.parametrize("name,tp", LAYOUTS)
def test_kv_cache_decoding_equals_full_recomputation(name, tp):
    for rank, res in enumerate(generation_results(name, tp)):
        assert res["gap"] < 1e-5, f"rank {rank}: cached logits differ from recomputation by {res['gap']:.2e}"


@pytest.mark.parametrize("name", SAMPLED)
def test_sampling_is_reproducible_and_the_same_on_every_tp_rank(name):
    tp1, tp2 = generation_results(name, 1)[0], generation_results(name, 2)
    tokens = lambda completions: [c.tokens for c in completions]  # noqa: E731
    reference = tokens(tp1["sampled"][0])
    assert tokens(tp1["sampled"][1]) == reference, "same seed, same tokens"
    assert tokens(tp1["other_seed"]) != reference, "another seed, other tokens"
    assert reference != [c.tokens[:16] for c in tp1["batched"]], "sampling is not greedy"
    for rank, res in enumerate(tp2):
        assert tokens(res["sampled"][0]) == tokens(res["sampled"][1]) == reference, f"TP rank {rank}"


def test_filtering_matches_hf_logits_warpers():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    cases = [(dict(temperature=0.7, top_k=10), [transformers.TemperatureLogitsWarper(0.7),
                                                 transformers.TopKLogitsWarper(10)]),
             (dict(temperature=1.3, top_p=0.8), [transformers.TemperatureLogitsWarper(1.3),
                                                  transformers.TopPLogitsWarper(0.8)]),
             (dict(top_k=30, top_p=0.5), [transformers.TopKLogitsWarper(30), transformers.TopPLogitsWarper(0.5)])]
    for kw, warpers in cases:
        expected = logits.clone()
        for w in warpers:
            expected = w(None, expected)
        got = filter_logits(logits, SamplingParams(**kw))
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), kw
        kept = ~torch.isinf(expected)
        assert torch.allclose(got[kept], expected[kept]), kw


def test_generation_stops_after_the_end_of_document_token():
    cfg, state = converted("llama_gqa")
    model = our_model(cfg, state)
    hf_tokens = [t for t, _ in hf_greedy("llama_gqa")]
    eod = hf_tokens[0][5]
    out = generate(model, PROMPTS, NEW, eod=eod)
    for got, expected in zip(out, hf_tokens):
        stop = expected.index(eod) + 1 if eod in expected else NEW
        assert got.tokens == expected[:stop] and len(got.logprobs) == stop


def test_moe_model_decodes_exactly_at_tp1():
    """An MoE model (top-2 of 4 experts in every layer) through the cache; TP > 1 is refused."""
    from megatron_lite.config import ModelConfig
    from megatron_lite.inference import inference_context
    from megatron_lite.inference.generation import check_generation_layout

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                      normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                      attention_dropout=0.0, hidden_dropout=0.0, init_method_std=0.1,
                      moe=dict(num_experts=4, moe_router_topk=2))
    dims = ParallelDims().build_groups()
    model = build_model(cfg, inference_context(cfg, dims), seed=3)[0]
    assert _recomputation_gap(model) < 1e-5
    with pytest.raises(ConfigError, match="MoE model runs at TP 1"):
        check_generation_layout(cfg, tp=2)


def test_the_cache_holds_what_the_attention_module_asks_for():
    """An attention module with a value head size of its own (MLA's kind) in the self-attention slot:
    the cache allocates its K [kv heads, d] and V [kv heads, dv] per layer, and decoding through the
    cache equals recomputation."""
    from dataclasses import replace

    from megatron_lite.config import ModelConfig
    from megatron_lite.inference import KVCache
    from megatron_lite.transformer.attention import AttentionConfig, SelfAttention
    from megatron_lite.transformer.spec import BuildContext
    from models.gpt import GPTModel, gpt_layer_spec

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                      normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                      attention_dropout=0.0, hidden_dropout=0.0)
    attention = functools.partial(SelfAttention, config=replace(AttentionConfig.from_model(cfg), v_head_dim=24))
    model = GPTModel(cfg, BuildContext(ParallelDims().build_groups()),
                     layer_spec=lambda cfg, ctx, i: replace(gpt_layer_spec(cfg, ctx, i), self_attention=attention))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    cache = KVCache.for_model(model, batch_size=3, max_length=10)
    assert {layer: [tuple(t.shape) for t in entry] for layer, entry in cache.buffers.items()} == {
        i: [(3, 10, 2, 16), (3, 10, 2, 24)] for i in range(2)}
    assert _recomputation_gap(model) < 1e-5


def test_generation_errors_are_clear():
    cfg, state = converted("gpt2")
    model = our_model(cfg, state)
    for kw, match in ((dict(temperature=0.0), "temperature"), (dict(top_p=0.0), "top-p"), (dict(top_k=-1), "top-k")):
        with pytest.raises(ConfigError, match=match):
            SamplingParams(**kw)
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        generate(model, [[1, VOCAB]], 4)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        generate(model, [list(range(40))], 30)  # GPT-2 here has 64 positions
    with pytest.raises(ConfigError, match="no tokens"):
        generate(model, [[1], []], 4)


# --- the tools, on a checkpoint written by pretrain_gpt at TP 2 --------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(checkpoint dir, the run's validation loss at its last iteration) of a tiny Llama
    trained 2 iterations at TP 2 on the built-in corpus (byte tokenizer)."""
    path = str(tmp_path_factory.mktemp("gen") / "ckpt")
    argv = TINY + LLAMA_SWITCHES + ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "2",
                                    "--tensor-model-parallel-size", "2", "--save", path]
    history = run_distributed(train_in_process, 2, argv)[0]
    return path, history[-1]["val_lm_loss"]


def _run_tool(tool, rank, world, argv):
    """tool.main(argv) on this rank: (exit status, stdout, stderr)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = tool.main(argv)
    finally:
        os.environ.update(RANK="0", WORLD_SIZE="1")
    return code, out.getvalue(), err.getvalue()


def _generate_worker(rank, world, argv):
    return _run_tool(generate_tool, rank, world, argv)


def _evaluate_worker(rank, world, argv):
    return _run_tool(evaluate_tool, rank, world, argv)


def _reference_greedy(path, prompt_ids, n):
    """Greedy tokens and log-probabilities by full recomputation with the checkpoint's weights."""
    from megatron_lite.checkpoint.model_only import load_model_weights, run_config

    cfg, _ = run_config(path)
    model = build_model(cfg.model, ParallelDims().build_groups())[0].eval()
    load_model_weights([model], cfg.model, path)
    seq, tokens, logprobs = list(prompt_ids), [], []
    with torch.no_grad():
        for _ in range(n):
            lp = model(torch.tensor([seq]))[0, -1].log_softmax(-1)
            t = int(lp.argmax())
            seq.append(t)
            tokens.append(t)
            logprobs.append(lp[t].item())
    return tokens, logprobs


GREEDY_JSON = ["--prompt", "def ", "--prompt", "import os\n", "--max-new-tokens", "12", "--greedy", "--json"]


def test_generate_tool_json_at_tp1_and_tp2(checkpoint):
    path, _ = checkpoint
    argv = ["--load", path] + GREEDY_JSON
    code, out, _ = _run_tool(generate_tool, 0, 1, argv)
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in records] == ["def ", "import os\n"]
    for r in records:
        assert r["prompt_ids"] == list(r["prompt"].encode())
        tokens, logprobs = _reference_greedy(path, r["prompt_ids"], 12)
        assert r["ids"] == tokens and r["finish_reason"] == "length"
        assert max(abs(a - b) for a, b in zip(r["logprobs"], logprobs)) < 1e-5
        assert r["text"] == bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
    results = run_distributed(_generate_worker, 2, argv + ["--tensor-model-parallel-size", "2", "--batch-size", "2"])
    assert results[1][1] == "", "only rank 0 prints"
    tp2 = [json.loads(line) for line in results[0][1].splitlines()]
    for a, b in zip(records, tp2):
        assert a["ids"] == b["ids"]
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < 1e-5


def test_generate_tool_streams_the_text_it_reports(checkpoint):
    path, _ = checkpoint
    argv = ["--load", path, "--prompt", "class ", "--max-new-tokens", "20", "--seed", "3", "--temperature", "0.8"]
    code, streamed, _ = _run_tool(generate_tool, 0, 1, argv)
    assert code == 0
    record = json.loads(_run_tool(generate_tool, 0, 1, argv + ["--json"])[1])
    assert streamed == "class " + record["text"] + "\n\n"


def test_every_prompt_and_row_samples_its_own_stream_and_a_seed_reproduces_them(checkpoint):
    """Issue 28: each prompt's generator was seeded afresh with --seed, so prompts drew the same numbers."""
    path, _ = checkpoint
    argv = ["--load", path, "--prompt", "def ", "--prompt", "def ", "--max-new-tokens", "16", "--temperature", "1",
            "--seed", "7", "--json"]
    for batch_size in ("1", "2"):  # one prompt per generate() call, and both rows of one batch
        runs = [[json.loads(line)["ids"] for line in _run_tool(generate_tool, 0, 1, argv + ["--batch-size",
                                                                                            batch_size])[1].splitlines()]
                for _ in range(2)]
        assert len(runs[0]) == 2 and runs[0] == runs[1], "the same seed reproduces every prompt"
        assert runs[0][0] != runs[0][1], f"identical prompts sample independently (--batch-size {batch_size})"


def test_generate_tool_null_tokenizer_prompts(checkpoint):
    path, _ = checkpoint
    byte_run = json.loads(_run_tool(generate_tool, 0, 1, ["--load", path] + GREEDY_JSON[:2] + GREEDY_JSON[4:])[1])
    argv = ["--load", path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
            "--prompt", " ".join(str(b) for b in b"def "), "--max-new-tokens", "12", "--greedy", "--json"]
    code, out, _ = _run_tool(generate_tool, 0, 1, argv)
    record = json.loads(out)
    assert code == 0 and record["ids"] == byte_run["ids"]
    assert record["text"] == " " + " ".join(str(t) for t in record["ids"])


@pytest.mark.parametrize("extra,message", [
    (["--load", "/nonexistent/ckpt"], "no checkpoint"),
    (["--top-p", "1.5"], "--top-p"),
    (["--temperature", "0"], "--temperature"),
    (["--pipeline-model-parallel-size", "2"], "tensor parallelism only"),
    (["--tensor-model-parallel-size", "2"], "ranks"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--prompt", "a b"], "cannot tokenize"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"], "vocab"),
    (["--prompt-file", "/nonexistent/prompts.txt"], "--prompt-file"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--no-such-flag"], "see --help"),
    (["--prompt", ""], "error: prompt 1 is empty: give it some text to continue"),
])
def test_generate_tool_errors_are_one_line(checkpoint, extra, message):
    path, _ = checkpoint
    argv = ["--load", path, "--prompt", "x"] + extra if "--load" not in extra else ["--prompt", "x"] + extra
    code, out, err = _run_tool(generate_tool, 0, 1, argv)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err


def test_a_prompt_longer_than_the_trained_length_is_warned_about(checkpoint):
    path, _ = checkpoint
    trained = int(TINY[TINY.index("--seq-length") + 1])
    code, out, err = _run_tool(generate_tool, 0, 1, ["--load", path, "--prompt", "y" * (trained + 3), "--greedy",
                                                     "--max-new-tokens", "1"])
    assert code == 0 and out.startswith("y" * (trained + 3))
    assert err == (f"> warning: a prompt of {trained + 3} tokens is longer than the {trained} tokens the model was "
                   f"trained on (its --seq-length): expect worse text\n"
                   f"> KV cache: {2 * 2 * 2 * 16 * 4} bytes per token per sequence on each TP rank\n"), err  # 2 layers,
    # K and V of 2 groups of 16 channels in fp32


def test_generate_tool_prompt_file(checkpoint, tmp_path):
    path, _ = checkpoint
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('def \n\n"import os\\n"\n')
    code, out, _ = _run_tool(generate_tool, 0, 1, ["--load", path, "--prompt-file", str(prompts)] + GREEDY_JSON[4:])
    from_flags = _run_tool(generate_tool, 0, 1, ["--load", path] + GREEDY_JSON)[1]
    assert code == 0 and out == from_flags


def test_generate_tool_from_a_converted_hf_checkpoint(tmp_path):
    """save_pretrained -> hf-to-ml at TP 2 (weights only, no run config) -> tools/generate.py at
    TP 1 with NullTokenizer id prompts: HF generate's greedy tokens."""
    name = "qwen3"
    hf_model(name).save_pretrained(tmp_path / "hf")
    ckpt = str(tmp_path / "ml")
    with contextlib.redirect_stdout(io.StringIO()):
        assert convert_checkpoint.main(["hf-to-ml", "--hf-dir", str(tmp_path / "hf"), "--out", ckpt,
                                        "--tensor-model-parallel-size", "2"]) == 0
    prompts = sum((["--prompt", " ".join(map(str, p))] for p in PROMPTS), [])
    argv = ["--load", ckpt, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--greedy", "--json",
            "--max-new-tokens", str(NEW), "--batch-size", "3"] + prompts
    code, out, err = _run_tool(generate_tool, 0, 1, argv)
    assert code == 0, err
    assert [json.loads(line)["ids"] for line in out.splitlines()] == [t for t, _ in hf_greedy(name)]


def test_generate_tool_takes_the_hf_tokenizer_hf_to_ml_copied(tmp_path):
    """A tokenizer beside the HF weights is the converted checkpoint's default: no tokenizer flag."""
    from test_hf_checkpoints import _word_tokenizer

    hf_model("qwen3").save_pretrained(tmp_path / "hf")
    _word_tokenizer(VOCAB).save_pretrained(tmp_path / "hf")
    ckpt = str(tmp_path / "ml")
    with contextlib.redirect_stdout(io.StringIO()):
        assert convert_checkpoint.main(["hf-to-ml", "--hf-dir", str(tmp_path / "hf"), "--out", ckpt]) == 0
    prompt = " ".join(f"w{i}" for i in PROMPTS[0])
    code, out, err = _run_tool(generate_tool, 0, 1, ["--load", ckpt, "--prompt", prompt, "--greedy", "--json",
                                                     "--max-new-tokens", str(NEW)])
    assert code == 0, err
    rec = json.loads(out)
    assert rec["prompt_ids"] == PROMPTS[0] and rec["ids"] == hf_greedy("qwen3")[0][0][:len(rec["ids"])]
    assert rec["text"].split() == [f"w{i}" for i in rec["ids"] if i != VOCAB - 1]


# --- evaluation -----------------------------------------------------------------------------
def test_evaluate_reproduces_the_validation_loss_at_any_layout(checkpoint):
    """The run validated at its last iteration, then saved those weights: evaluating them on the
    same validation batches gives its number, at TP 1, at TP 2 and at PP 2."""
    path, val_loss = checkpoint
    code, out, err = _run_tool(evaluate_tool, 0, 1, ["--load", path, "--json"])
    assert code == 0, err
    rec = json.loads(out)
    assert abs(rec["lm_loss"] - val_loss) <= 1e-5 * val_loss
    assert rec["perplexity"] == pytest.approx(math.exp(val_loss), rel=1e-5)
    assert rec["iteration"] == 2 and rec["samples"] == 2 * 4
    for layout in (["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]):
        results = run_distributed(_evaluate_worker, 2, ["--load", path, "--json"] + layout)
        rec = next(json.loads(r[1]) for r in results if r[1])
        assert abs(rec["lm_loss"] - val_loss) <= 1e-5 * val_loss, layout


def test_evaluate_a_data_path_whole(checkpoint, tmp_path):
    """--data-path: one pass over all of it; the loss of those samples by a plain forward."""
    from megatron_lite.checkpoint.model_only import load_model_weights, run_config
    from megatron_lite.data import build_tokenizer, build_train_valid_test_datasets
    from megatron_lite.data.indexed_dataset import IndexedDatasetWriter

    path, _ = checkpoint
    prefix = str(tmp_path / "corpus")
    writer = IndexedDatasetWriter(prefix, dtype=np.uint16)
    for name in ("os.py", "json/__init__.py", "functools.py"):
        text = open(os.path.join(os.path.dirname(os.__file__), name), encoding="utf-8").read()[:700]
        writer.add_document(np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint16))
    writer.finalize()
    code, out, err = _run_tool(evaluate_tool, 0, 1, ["--load", path, "--data-path", prefix, "--json"])
    assert code == 0, err
    rec = json.loads(out)
    cfg, _ = run_config(path)
    cfg.data.data_path, cfg.data.split = [prefix], "0,1,0"
    _, valid, _ = build_train_valid_test_datasets(cfg.data, build_tokenizer("ByteTokenizer"), 64, cfg.training.seed,
                                                  (0, 0, 0))
    assert rec["samples"] == len(valid) // 4 * 4 and rec["samples"] > 8
    model = build_model(cfg.model, ParallelDims().build_groups())[0].eval()
    load_model_weights([model], cfg.model, path)
    with torch.no_grad():
        losses = [model(valid[i]["tokens"][None], labels=valid[i]["labels"][None]).mean() for i in range(rec["samples"])]
    assert rec["lm_loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)


@pytest.mark.parametrize("extra,message", [
    (["--hidden-size", "128"], "the model comes from the checkpoint"),
    (["--tensor-model-parallel-size", "3"], "divisible"),
    ([], "--load CKPT is required"),
])
def test_evaluate_errors_are_one_line(checkpoint, extra, message):
    argv = (["--load", checkpoint[0]] if extra else []) + extra
    code, out, err = _run_tool(evaluate_tool, 0, 1, argv)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err


def test_generation_never_picks_a_padded_vocabulary_row():
    """A model that keeps Megatron's padded rows (tokenizer_vocab_size < vocab_size) generates only
    the tokenizer's ids, even where a padded row has the largest logit."""
    from megatron_lite.config import ModelConfig
    from megatron_lite.parallel.state import ParallelDims
    from models.gpt import build_model
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, tokenizer_vocab_size=50,
                      untie_embeddings_and_output_weights=True, attention_dropout=0.0, hidden_dropout=0.0)
    model = build_model(cfg, ParallelDims(), seed=3)[0]
    with torch.no_grad():
        model.output_layer.weight[50:] *= 1000  # the padded rows dominate the logits
    assert model(torch.tensor([[1, 2, 3]]))[0, -1].argmax().item() >= 50
    out = generate(model, [[1, 2, 3]], 8)[0].tokens
    assert len(out) == 8 and max(out) < 50
