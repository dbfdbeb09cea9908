"""Megatron-LM checkpoints into training, through tools/convert_checkpoint.py megatron-to-ml.

The oracle is Megatron-Core 0.16.1 itself (tests/mcore_cpu.py runs it on CPU): a tiny GPTModel
(local spec) in a gloo world of TP=2 x PP=2 forked ranks, every weight random (norms and biases
too), saved by Megatron-Core's own dist_checkpointing.save (torch_dist) and as Megatron-LM's
legacy per-rank files (each rank's state dict + the args Namespace + RNG states). Its forward
over the pipeline gives the logits. For a GPT-2-like model (LayerNorm, learned positions, biases,
tanh GELU through Megatron's fused bias-GELU, tied embeddings; the vocabulary kept padded) and a
Llama-like one (RMSNorm, RoPE, SwiGLU, GQA with 2 groups for 4 heads, untied output; NullTokenizer
args), each format converted to TP1 and to TP2 x PP2 gives Megatron's logits, padded rows included,
and a training run started from it has Megatron's loss as its first loss (its softmax over the
padded vocabulary); with --trim-padded-vocab, the loss over the tokenizer's vocabulary. The GPT-2 world splits
its 4 layers 1 + 3 over the stages; a third world (the Llama model at PP=2 with two virtual stages
per rank) checks the chunks' layer numbering. Every class Megatron-Core declares safe in its
checkpoints unpickles without megatron-core's code, and nothing else does; bad inputs are one-line
errors with exit status 2.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

from mcore_cpu import import_mcore  # noqa: E402  (first: before any other megatron.core import)

if import_mcore() is None:
    pytest.skip("megatron-core is not installed (pip install megatron-core==0.16.1)", allow_module_level=True)

import mcore_cpu  # noqa: E402
from megatron_lite.checkpoint.offline import full_weights, open_checkpoint  # noqa: E402
from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.data.gpt_dataset import MockGPTDataset, SampleOptions  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402
from models.gpt import build_model  # noqa: E402
from training_utils import ROOT, logits_of_checkpoint, train_in_process  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tools"))
import convert_checkpoint as tool  # noqa: E402

SEQ, BATCH, SEED, ITERATION = 16, 4, 1234, 5
PADDED = 256  # Megatron-LM's padding of either vocabulary: a multiple of 128 x TP
_BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, max_position_embeddings=32, norm_epsilon=1e-5)
SHAPES = {
    # tanh GELU (the fused bias-GELU), tied embeddings, the vocabulary kept whole (tokenizer unknown)
    "gpt2": dict(_BASE, ffn_hidden_size=128, normalization="LayerNorm", position_embedding_type="learned_absolute",
                 swiglu=False, add_bias_linear=True, bias_gelu_fusion=True, untie_embeddings_and_output_weights=False,
                 vocab=PADDED),
    # NullTokenizer with 199 ids + end of document: 200 true rows of the 256
    "llama": dict(_BASE, num_query_groups=2, ffn_hidden_size=96, normalization="RMSNorm",
                  position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True, vocab=200, null_tokenizer=199),
}
# Megatron-Core worlds: name -> (shape, TP, PP, virtual PP[, shape changes])
WORLDS = {"gpt2": ("gpt2", 2, 2, 1, dict(first_stage_layers=1, last_stage_layers=3)),  # an uneven split
          "llama": ("llama", 2, 2, 1),
          "llama-vpp": ("llama", 1, 2, 2)}  # two chunks per stage (model0 / model1), a layer each
FORMATS = ("torch_dist", "legacy")
LAYOUTS = {"tp1": ([], 1), "tp2pp2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4)}


def _batch(vocab: int):
    """The first global batch of a --mock-data run with this vocabulary (samples 0..BATCH-1)."""
    data = MockGPTDataset(vocab, SEQ, BATCH, SEED, SampleOptions(eod=vocab - 1))
    return (torch.stack([data[i]["tokens"] for i in range(BATCH)]),
            torch.stack([data[i]["labels"] for i in range(BATCH)]))


def _world(name):
    family, tp, pp, vpp, *extra = WORLDS[name]
    return dict(SHAPES[family], **(extra[0] if extra else {})), tp, pp, vpp


def _megatron_world(rank, world, name, root):
    """One rank of a Megatron-Core world: build, save in both formats, forward."""
    from megatron.core import parallel_state

    shape, tp, pp, vpp = _world(name)
    mcore_cpu.cpu_shims()
    chunks = mcore_cpu.build_gpt(shape, tp, pp, PADDED, vpp)
    tp_rank, pp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    for fmt in FORMATS:
        args = mcore_cpu.megatron_args(shape, tp, pp, PADDED, "torch_dist" if fmt == "torch_dist" else "torch", vpp)
        if shape.get("null_tokenizer"):
            args.tokenizer_type, args.vocab_size = "NullTokenizer", shape["null_tokenizer"]
        if fmt == "torch_dist":
            mcore_cpu.save_torch_dist(chunks, args, os.path.join(root, fmt), ITERATION)
        else:
            mcore_cpu.save_legacy(chunks, args, os.path.join(root, fmt), ITERATION, tp_rank, pp_rank, pp)
    logits = mcore_cpu.forward_logits(chunks, _batch(shape["vocab"])[0], pp)
    return logits if logits is not None and tp_rank == 0 else None


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """world -> (checkpoint roots by format, Megatron-Core's logits [b, s, PADDED] on the batch)."""
    out = {}
    for name in WORLDS:
        _, tp, pp, _ = _world(name)
        root = str(tmp_path_factory.mktemp(f"megatron-{name}"))
        results = run_distributed(_megatron_world, tp * pp, name, root, daemon=False)
        out[name] = ({fmt: os.path.join(root, fmt) for fmt in FORMATS}, next(r for r in results if r is not None))
    return out


class Stranger:
    """A class Megatron-LM never pickles: a file naming it must be refused, not unpickled."""

    def __reduce__(self):
        return (Stranger, ())


def _convert(*args) -> int:
    return tool.main([str(a) for a in args])


def _our_logits(ckpt, tokens):
    """Our single-process forward from the converted checkpoint's full weights."""
    return logits_of_checkpoint(ckpt, tokens)[:2]


def _logit_cases():
    for name in WORLDS:
        for fmt in FORMATS:
            for layout in LAYOUTS if name in SHAPES else ("tp1",):
                yield name, fmt, layout


@pytest.mark.parametrize("name,fmt,layout", list(_logit_cases()))
def test_converted_logits_equal_megatron_core(megatron, tmp_path, name, fmt, layout):
    roots, reference = megatron[name]
    flags, world = LAYOUTS[layout]
    ckpt = tmp_path / "ckpt"
    assert _convert("megatron-to-ml", "--load", roots[fmt], "--out", ckpt, *flags) == 0
    meta = json.load(open(ckpt / "iter_0000000" / "metadata.json"))
    assert meta["weights_only"] and meta["layout"]["world_size"] == world and len(meta["files"]) == world
    vocab = _world(name)[0]["vocab"]
    logits, cfg = _our_logits(ckpt, _batch(vocab)[0])
    assert cfg.vocab_size == PADDED and logits.shape == (BATCH, SEQ, PADDED)  # Megatron's padding kept
    assert cfg.tokenizer_vocab == vocab
    assert (logits - reference).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", list(SHAPES))
def test_megatron_table_round_trips(name):
    """Our tensors -> Megatron-Core's names and layouts (fused QKV per query group) -> ours again."""
    from models.hf_conversion import hf_to_ours_stream, our_sizes, ours_to_hf_stream
    from models.megatron_conversion import MEGATRON_RULES

    shape = SHAPES[name]
    cfg = ModelConfig(**{k: v for k, v in shape.items() if k in ModelConfig.__dataclass_fields__}, vocab_size=shape["vocab"])
    ours = {n: p.detach() for n, p in build_model(cfg, ParallelDims())[0].named_parameters()}
    theirs = dict(ours_to_hf_stream(ours.__getitem__, cfg, MEGATRON_RULES))
    qkv = theirs["decoder.layers.0.self_attention.linear_qkv.weight"]
    per, d = cfg.num_attention_heads // cfg.num_query_groups, cfg.kv_channels
    assert torch.equal(qkv[per * d:(per + 1) * d], ours["layers.0.self_attention.linear_kv.weight"][:d])  # group 0's k
    back = dict(hf_to_ours_stream(theirs.__getitem__, theirs.__contains__, cfg, MEGATRON_RULES, our_sizes(cfg)))
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)


def test_torch_dist_is_read_a_layer_at_a_time(megatron, tmp_path, monkeypatch):
    """A stacked [layers, ...] tensor is never read whole: every read is one box no larger than the
    largest single tensor of the model (the word embeddings here: the stacked fc1 is twice that)."""
    import models.megatron_checkpoint as reader

    sizes, load = [], reader.dcp.load

    def spy(state_dict, **kwargs):
        sizes.extend(t.numel() for t in state_dict.values())
        return load(state_dict, **kwargs)

    monkeypatch.setattr(reader.dcp, "load", spy)
    assert _convert("megatron-to-ml", "--load", megatron["gpt2"][0]["torch_dist"], "--out", tmp_path / "ckpt") == 0
    shape = SHAPES["gpt2"]
    stacked_fc1 = shape["num_layers"] * shape["ffn_hidden_size"] * shape["hidden_size"]
    assert max(sizes) == PADDED * shape["hidden_size"] < stacked_fc1


def _megatron_loss(reference, vocab, rows=PADDED):
    """The mean token cross entropy on the batch over the first `rows` logits: Megatron's own loss
    with every row of its padded vocabulary (the batch's tokens from the tokenizer's `vocab`)."""
    labels = _batch(vocab)[1]
    return F.cross_entropy(reference[..., :rows].reshape(-1, rows), labels.reshape(-1)).item()


@pytest.mark.parametrize("name,fmt,layout,trim", [("gpt2", "legacy", "tp2pp2", False),
                                                  ("llama", "torch_dist", "tp2pp2", False),
                                                  ("llama", "legacy", "tp1", False), ("llama", "legacy", "tp1", True)])
def test_training_starts_with_megatrons_loss(megatron, tmp_path, name, fmt, layout, trim):
    """Megatron's padded rows are logits in its softmax: kept, the first loss is Megatron-Core's;
    --trim-padded-vocab gives the loss over the tokenizer's vocabulary (lower: fewer rows share the softmax)."""
    roots, reference = megatron[name]
    flags, world = LAYOUTS[layout]
    ckpt = tmp_path / "ckpt"
    assert _convert("megatron-to-ml", "--load", roots[fmt], "--out", ckpt, *flags,
                    *(["--trim-padded-vocab"] if trim else [])) == 0
    vocab = SHAPES[name]["vocab"]
    expected = _megatron_loss(reference, vocab, rows=vocab if trim else PADDED)
    if vocab < PADDED:  # the two semantics differ measurably on this batch
        assert abs(_megatron_loss(reference, vocab, rows=vocab) - _megatron_loss(reference, vocab)) > 0.05
    run = ["--mock-data", "--vocab-size", str(vocab - 1), "--seq-length", str(SEQ), "--micro-batch-size", "2",
           "--global-batch-size", str(BATCH), "--train-iters", "1", "--eval-iters", "0", "--device", "cpu",
           "--use-checkpoint-args", "--seed", str(SEED), "--load", str(ckpt)] + flags
    first = next(h[0] for h in run_distributed(train_in_process, world, run) if h and h[0]["lm_loss"] is not None)
    assert abs(first["lm_loss"] - expected) < 1e-4, (first["lm_loss"], expected)


def test_allow_list_is_megatron_cores_safe_globals(tmp_path):
    """What Megatron-Core registers as safe for torch.load (megatron/core/safe_globals.py) loads
    with the converter's allow-list alone, its classes as inert stand-ins; a class outside the list
    is refused even where this process registered it as safe."""
    from megatron.core.safe_globals import SAFE_GLOBALS

    from models.megatron_checkpoint import ALLOWED, ConversionError, safe_load

    assert {f"{c.__module__}.{c.__qualname__}" for c in SAFE_GLOBALS} <= ALLOWED
    import argparse
    import io
    import pathlib
    import signal
    import types

    import numpy as np
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.rerun_state_machine import RerunMode
    from megatron.core.transformer.enums import AttnBackend, CudaGraphScope

    args = argparse.Namespace(attention_backend=AttnBackend.flash, cuda_graph_scope=[CudaGraphScope.attn],
                              save=pathlib.PosixPath("/ckpt"), exit_signal=signal.SIGTERM, rerun_mode=RerunMode.DISABLED,
                              extra=types.SimpleNamespace(x=1), params_dtype=torch.bfloat16)
    torch.save({"args": args, "optimizer_config": OptimizerConfig(lr=3e-4), "te": io.BytesIO(b"fp8 meta"),
                "rng": np.random.get_state()}, tmp_path / "ok.pt")
    state = safe_load(str(tmp_path / "ok.pt"))
    a = state["args"]
    assert a.save == pathlib.PosixPath("/ckpt") and a.exit_signal == signal.SIGTERM and a.extra.x == 1
    assert a.attention_backend.value == AttnBackend.flash.value and not isinstance(a.attention_backend, AttnBackend)
    assert state["optimizer_config"].state["lr"] == 3e-4 and state["te"].getvalue() == b"fp8 meta"
    torch.save({"args": args, "stranger": Stranger()}, tmp_path / "bad.pt")
    with torch.serialization.safe_globals([Stranger]):
        with pytest.raises(ConversionError, match="refused to unpickle test_megatron_checkpoints.Stranger"):
            safe_load(str(tmp_path / "bad.pt"))
        assert Stranger in torch.serialization.get_safe_globals(), "the process's registrations come back"


def test_bad_inputs_are_one_line_errors(megatron, tmp_path, capsys):
    roots = megatron["llama"][0]
    legacy = os.path.join(roots["legacy"], f"iter_{ITERATION:07d}")
    out = tmp_path / "o"

    def broken(tag):
        d = tmp_path / tag
        shutil.copytree(legacy, d)
        return d

    pickled = broken("pickled")  # a class that is not on the allow-list
    path = pickled / "mp_rank_01_001" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["extra"] = {"deque": __import__("collections").deque([1]), "stranger": Stranger()}
    torch.save(state, path)
    assert _convert("megatron-to-ml", "--load", pickled, "--out", out) == 2
    dcp_pickle = tmp_path / "dcp"  # torch_dist: .metadata is a pickle too (DCP itself would unpickle anything)
    shutil.copytree(os.path.join(megatron["llama"][0]["torch_dist"], f"iter_{ITERATION:07d}"), dcp_pickle)
    with open(dcp_pickle / ".metadata", "wb") as f:
        pickle.dump(Stranger(), f)
    assert _convert("megatron-to-ml", "--load", dcp_pickle, "--out", out) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no checkpoint here")
    assert _convert("megatron-to-ml", "--load", empty, "--out", out) == 2
    missing = broken("missing")
    shutil.rmtree(missing / "mp_rank_01_000")
    assert _convert("megatron-to-ml", "--load", missing, "--out", out) == 2
    interleaved = broken("interleaved")
    path = interleaved / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["args"].rotary_interleaved = True
    torch.save(state, path)
    assert _convert("megatron-to-ml", "--load", interleaved, "--out", out) == 2
    moe = broken("moe")
    state["args"].rotary_interleaved, state["args"].num_experts = False, 8
    torch.save(state, moe / "mp_rank_00_000" / "model_optim_rng.pt")
    assert _convert("megatron-to-ml", "--load", moe, "--out", out) == 2
    grouped = broken("grouped")
    state["args"].moe_grouped_gemm = True
    torch.save(state, grouped / "mp_rank_00_000" / "model_optim_rng.pt")
    assert _convert("megatron-to-ml", "--load", grouped, "--out", out) == 2
    # trimming needs the tokenizer's vocabulary: the GPT-2 world's args do not say it
    assert _convert("megatron-to-ml", "--load", megatron["gpt2"][0]["legacy"], "--out", out, "--trim-padded-vocab") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 8, err
    for line, fragment in zip(err, ["collections.deque, test_megatron_checkpoints.Stranger",
                                    "refused to unpickle test_megatron_checkpoints.Stranger", "neither", "missing TP shard", "rotary_interleaved",
                                    "lacks",  # (args that say MoE over dense tensors)
                                    "legacy checkpoints of grouped-GEMM experts",
                                    "--trim-padded-vocab needs the tokenizer's vocabulary"]):
        assert line.startswith("convert_checkpoint.py megatron-to-ml: error: ") and fragment in line, line
    assert not out.exists()


# --- back to Megatron-LM: ml-to-megatron ------------------------------------------------------------
def _megatron_loads(rank, world, shape, tp, pp, root, tokens, fmt):
    """One rank of a Megatron-Core world whose GPTModel loads (strictly) what ml-to-megatron wrote:
    its rank's legacy file, or its sharded state dict through Megatron-Core's dist_checkpointing.load;
    then Megatron-Core's forward."""
    from megatron.core import dist_checkpointing, parallel_state

    from models.megatron_checkpoint import safe_load

    mcore_cpu.cpu_shims()
    chunks = mcore_cpu.build_gpt(shape, tp, pp, PADDED)
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    release = os.path.join(root, "release")
    if fmt == "torch_dist":  # (Megatron-LM's own list of what its torch.load may unpickle, as importing it registers)
        from megatron.core.safe_globals import SAFE_GLOBALS
        torch.serialization.add_safe_globals(SAFE_GLOBALS)
        sharded = chunks[0].sharded_state_dict(metadata={"singleton_local_shards": False})
        state = dict(dist_checkpointing.load({"model": sharded}, release),
                     args=safe_load(release + "/common.pt")["args"])
    else:
        state = safe_load(os.path.join(release, f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""),
                                       "model_optim_rng.pt"))
        assert state["args"].tensor_model_parallel_size == tp
    assert state["args"].padded_vocab_size == PADDED and state["args"].ckpt_format == fmt
    chunks[0].load_state_dict(state["model"], strict=True)
    logits = mcore_cpu.forward_logits(chunks, tokens, pp)
    return logits if logits is not None and t == 0 else None


@pytest.mark.parametrize("fmt,name,tp,pp,world", [
    ("torch", "llama", 1, 1, None), ("torch", "llama", 2, 2, None), ("torch", "gpt2", 2, 1, None),
    ("torch", "gpt2", 1, 2, None), ("torch_dist", "llama", 2, 2, None), ("torch_dist", "gpt2", 1, 2, None),
    ("torch_dist", "llama", 1, 1, (2, 2))])  # written for TP1, loaded at TP2 x PP2 (the same padded vocabulary)
def test_ml_to_megatron_loads_into_megatron_core(megatron, tmp_path, fmt, name, tp, pp, world):
    """megatron -> ml -> ml-to-megatron (legacy or torch_dist, for TP x PP): Megatron-Core's GPTModel
    (at TP x PP, or at `world` for torch_dist) loads it strictly and its logits (and so its first
    loss) are ours; megatron-to-ml of it gives our checkpoint back bit for bit."""
    shape, vocab = SHAPES[name], SHAPES[name]["vocab"]
    ml, back, out = tmp_path / "ml", tmp_path / "back", tmp_path / "megatron"
    assert _convert("megatron-to-ml", "--load", megatron[name][0]["legacy"], "--out", ml, "--vocab-size", vocab) == 0
    assert _convert("ml-to-megatron", "--load", ml, "--out", out, "--tensor-model-parallel-size", tp,
                    "--pipeline-model-parallel-size", pp, "--ckpt-format", fmt) == 0
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    tokens, labels = _batch(vocab)
    load_tp, load_pp = world or (tp, pp)
    theirs = next(r for r in run_distributed(_megatron_loads, load_tp * load_pp, shape, load_tp, load_pp, str(out),
                                             tokens, fmt, daemon=False)
                  if r is not None)
    ours, _ = _our_logits(ml, tokens)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)  # Megatron's padded rows too
    loss = [F.cross_entropy(x.reshape(-1, PADDED), labels.reshape(-1)).item() for x in (theirs, ours)]
    assert loss[0] == pytest.approx(loss[1], rel=1e-6)
    assert _convert("megatron-to-ml", "--load", out, "--out", back, "--vocab-size", vocab) == 0
    with open_checkpoint(str(ml)) as a, open_checkpoint(str(back)) as b:
        assert a.meta["model_config"] == b.meta["model_config"]
        wa, wb = full_weights(a, fp32_from_main=False), full_weights(b, fp32_from_main=False)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_ml_to_megatron_refuses_what_it_does_not_write(megatron, tmp_path, capsys):
    ml = tmp_path / "ml"
    assert _convert("megatron-to-ml", "--load", megatron["llama"][0]["legacy"], "--out", ml) == 0
    capsys.readouterr()
    assert _convert("ml-to-megatron", "--load", ml, "--out", tmp_path / "o", "--pipeline-model-parallel-size", 3) == 2
    moe = tmp_path / "moe"  # (refused from the config, before any tensor is read)
    tool.write_ml_checkpoint(str(moe), ModelConfig(add_bias_linear=False, moe={  # (HF's norm_topk_prob)
        "num_experts": 4, "moe_router_pre_softmax": True, "moe_router_norm_topk_prob": True}), {})
    assert _convert("ml-to-megatron", "--ml-dir", moe, "--out", tmp_path / "o") == 2
    assert _convert("ml-to-megatron", "--ml-dir", moe, "--out", tmp_path / "o", "--expert-model-parallel-size", 3) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 3 and "pp=3" in err[0], err
    assert "moe_router_norm_topk_prob=True (from a HF config) differs from Megatron-LM's rule" in err[1], err
    assert "expert_model_parallel_size (3) must divide the model's 4 experts" in err[2], err
    assert not (tmp_path / "o").exists()
