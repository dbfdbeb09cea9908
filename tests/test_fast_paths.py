"""The fast paths give the numbers of the reference paths, and refuse clearly where they cannot run.

- Chunked vocab-parallel cross entropy (only a chunk's fp32 logits at a time): loss and logits
  gradient equal the whole-micro-batch cross entropy at TP 1/2/4, fp32 and bf16, padded vocab,
  ignored labels and a label outside the vocabulary, chunk sizes that do not divide the tokens;
  the same collectives; in training (bf16, TP 2 + SP) the losses of the unchunked run.
- `--compile` (torch.compile per transformer layer) on the CPU: the eager run's losses and final
  parameters to 1e-5, alone and with TP 2 + SP, pipeline 1F1B + full recomputation, ZeRO-3.
- Missing compilers and packages: one-line errors naming the fix; the start-up line names the
  fast paths taken.
"""
import pytest
import torch

from megatron_lite.errors import ConfigError
from megatron_lite.parallel import comm
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.parallel.tensor_parallel import vocab_parallel_cross_entropy
from megatron_lite.testing import assert_same_run, run_distributed
from megatron_lite.transformer import fast_paths
from pretrain_gpt import resolve
from test_tp_overlap import ce_inputs
from training_utils import LLAMA_SWITCHES, TINY, merged_params, records_of, train_and_gather, train_in_process


# --- chunked cross entropy ----------------------------------------------------------------------
def _ce_chunked_vs_whole(rank, world, vocab, padded, dtype, chunks):
    dims, local, target, weights = ce_inputs(world, vocab, padded, dtype, seed=11, rows=7, scale=4.0)
    out = {}
    for chunk in (0, *chunks):
        for inplace in (False, True):
            logits = local.clone().requires_grad_(True)
            source = logits.detach().clone()
            dims.comm_counter = comm.CommCounter()
            loss = vocab_parallel_cross_entropy(logits * 1 if inplace else logits, target, dims, vocab,
                                                inplace=inplace, chunk_tokens=chunk)
            (loss * weights).sum().backward()
            out[chunk, inplace] = dict(loss=loss.detach(), grad=logits.grad,
                                       calls=dims.comm_counter.reset(), untouched=torch.equal(logits.detach(), source))
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("vocab,padded", [(64, 64), (37, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_equals_the_whole_micro_batch(tp, vocab, padded, dtype):
    chunks = (1, 4, 5, 21)  # 21 tokens: one token, uneven chunks, one chunk of all
    for r in run_distributed(_ce_chunked_vs_whole, tp, vocab, padded, dtype, chunks):
        ref = r[0, False]
        assert torch.isfinite(ref["loss"]).all() and ref["loss"][0, 1] == 0
        assert ref["grad"][0, 1].abs().max() == 0, "an ignored label has no gradient"
        for chunk in chunks:
            for inplace in (False, True):
                got = r[chunk, inplace]
                torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-6, atol=1e-6)
                tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: the gradient is stored in bf16
                torch.testing.assert_close(got["grad"].float(), ref["grad"].float(), rtol=tol, atol=tol)
                assert got["untouched"], "the caller's own tensor is never written"
                assert got["calls"] == ref["calls"], f"chunk {chunk}: {got['calls']} vs {ref['calls']} bytes"


def _ce_far_below_zero(rank, world):
    dims = ParallelDims.from_world(tp=world)
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(5, 2, 64, generator=gen) - 200.0  # every logit far below exp's range
    target = torch.randint(0, 37, (5, 2), generator=gen)
    local = full.chunk(world, dim=-1)[dims.tp_rank]  # 37 of 64 columns real: rank 3 holds padding only
    return [vocab_parallel_cross_entropy(local.clone(), target, dims, 37, chunk_tokens=c) for c in (0, 3)]


def test_chunked_cross_entropy_with_a_padding_only_rank_and_very_negative_logits():
    for whole, chunked in run_distributed(_ce_far_below_zero, 4):
        assert torch.isfinite(chunked).all()
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


def test_automatic_chunk_size():
    assert fast_paths.cross_entropy_chunk_tokens(None, torch.float32, 50304) == 0  # in place already
    chunk = fast_paths.cross_entropy_chunk_tokens(None, torch.bfloat16, 32000)
    assert chunk * 32000 * 4 <= fast_paths.CHUNK_BYTES < (chunk + 1) * 32000 * 4
    assert fast_paths.cross_entropy_chunk_tokens(128, torch.bfloat16, 32000) == 128
    assert fast_paths.cross_entropy_chunk_tokens(0, torch.bfloat16, 32000) == 0


BF16 = TINY + LLAMA_SWITCHES + ["--bf16", "--train-iters", "3"]
BF16_LAYOUTS = {"tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                "pp2-cp2": (4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"])}


@pytest.mark.parametrize("layout", list(BF16_LAYOUTS))
def test_chunked_cross_entropy_in_bf16_training_keeps_the_losses(layout):
    world, extra = BF16_LAYOUTS[layout]
    whole = run_distributed(train_in_process, world, BF16 + extra + ["--cross-entropy-chunk-size", "0"])
    chunked = run_distributed(train_in_process, world, BF16 + extra + ["--cross-entropy-chunk-size", "48"])
    # bf16 weights: the logits gradient is rounded to bf16 either way; the losses agree closely.
    whole, chunked = (next(h for h in runs if h and h[0]["lm_loss"] is not None) for runs in (whole, chunked))
    assert len(whole) == len(chunked) == 3
    for a, b in zip(whole, chunked):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 2e-3 * abs(a["lm_loss"]), (a["lm_loss"], b["lm_loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 2e-2 * a["grad_norm"]


# --- torch.compile per layer --------------------------------------------------------------------
COMPILE_BASE = TINY + LLAMA_SWITCHES + ["--train-iters", "3"]

COMPILE_LAYOUTS = {
    "single": (1, []),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2-1f1b-full-recompute": (2, ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full"]),
    "dp2-zero3": (2, ["--zero-stage", "3"]),
}
COMPILE_SLOW = {"tp2-sp", "pp2-1f1b-full-recompute"}  # one compile each: ~30 s on 2 cores


@pytest.mark.skipif(fast_paths.compile_problem("cpu") is not None, reason="no C++ compiler for TorchInductor")
@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in COMPILE_SLOW else k
                                    for k in COMPILE_LAYOUTS])
def test_compile_equals_eager(layout):
    world, extra = COMPILE_LAYOUTS[layout]
    eager = run_distributed(train_and_gather, world, COMPILE_BASE + extra)
    compiled = run_distributed(train_and_gather, world, COMPILE_BASE + extra + ["--compile"])
    assert_same_run(records_of([r[0] for r in eager]), records_of([r[0] for r in compiled]), rtol=1e-5,
                    params=merged_params(compiled), ref_params=merged_params(eager))


def _compiled_layers(rank, world, argv):
    import os

    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    cfg, tokenizer = resolve(argv)
    trainer = make_trainer(cfg, tokenizer, torch.device("cpu"))
    layers = [m for c in trainer.chunks for m in c.layers.values()]
    names = sorted(n for c in trainer.chunks for n, _ in c.named_parameters())
    return [m.compiled for m in layers], names


def test_compile_marks_every_layer_and_keeps_parameter_names():
    compiled, names = run_distributed(_compiled_layers, 1, COMPILE_BASE + ["--compile"])[0]
    _, eager_names = run_distributed(_compiled_layers, 1, COMPILE_BASE)[0]
    assert compiled and all(compiled)
    assert names == eager_names, "checkpoints must not see the compile (no _orig_mod prefixes)"


def _tiny_compiled_model(monkeypatch, store=None):
    """A 2-layer Llama with --compile's layers, compiled by Dynamo's eager backend (Dynamo's
    tracing rules, without the C++ compile time)."""
    from megatron_lite.config import ModelConfig
    from megatron_lite.parallel.gemm import GemmPath
    from megatron_lite.transformer import block
    from models.gpt import build_model

    compiled = torch.compile(block.TransformerLayer._forward, backend="eager")
    monkeypatch.setattr(block, "compiled_layer_forward", lambda: compiled)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                      vocab_size=64, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                      add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                      attention_dropout=0.0)
    return build_model(cfg, ParallelDims(), seed=5, compile=True, gemm=store or GemmPath())[0]


def test_compiled_layers_still_defer_weight_gradients(monkeypatch):
    """Zero-bubble's B pass under --compile queues the same weight-gradient work as eager: the
    deferral is decided in eager backward, not frozen into a compiled one."""
    from megatron_lite.parallel.gemm import GemmPath

    queued = {}
    for compiled in (False, True):
        store = GemmPath(deferrable=True)
        model = _tiny_compiled_model(monkeypatch, store)
        for layer in model.layers.values():
            layer.compiled = compiled
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        store.deferring = True
        loss.backward()
        store.deferring = False
        queued[compiled] = len(store.take())
    assert queued[True] == queued[False] > 2 * 4  # q, kv, proj, fc1, fc2 per layer (and the output layer)


def test_a_compiled_model_deepcopies_and_pickles(monkeypatch):
    import copy
    import io

    model = _tiny_compiled_model(monkeypatch)
    tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        assert not torch.allclose(twin(tokens), model(tokens)), "the copy must compute with its own weights"
    torch.save(model, io.BytesIO())


def test_compile_without_a_compiler_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(fast_paths.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match=r"--compile: TorchInductor on the CPU needs a C\+\+ compiler.*drop --compile"):
        resolve(COMPILE_BASE + ["--compile"])


def test_compile_on_cuda_without_triton_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(fast_paths.importlib.util, "find_spec", lambda name: None)
    assert "triton" in fast_paths.compile_problem("cuda")
    with pytest.raises(ConfigError, match="--compile: TorchInductor on CUDA needs the triton package"):
        resolve([a if a != "cpu" else "cuda" for a in COMPILE_BASE] + ["--compile"])


def test_negative_chunk_size_is_refused():
    with pytest.raises(ConfigError, match=r"--cross-entropy-chunk-size \(-1\) must be >= 0"):
        resolve(COMPILE_BASE + ["--cross-entropy-chunk-size", "-1"])


@pytest.mark.parametrize("flags", [["--transformer-impl", "transformer_engine"], ["--fp4-format", "e2m1"]])
def test_transformer_engine_flags_are_one_line_errors(flags):
    with pytest.raises(ConfigError) as e:
        resolve(COMPILE_BASE + flags)
    assert "\n" not in str(e.value) and flags[0] in str(e.value)


def test_start_up_line_names_the_fast_paths():
    line = fast_paths.describe_fast_paths(device="cpu", params_dtype=torch.bfloat16, compile=True, chunk_setting=None,
                                          vocab_per_rank=32000, normalization="RMSNorm", fused_adamw=True)
    chunk = fast_paths.cross_entropy_chunk_tokens(None, torch.bfloat16, 32000)
    assert line == (f"norm F.rms_norm | compile per layer (inductor) | cross entropy chunked ({chunk} tokens) | "
                    "AdamW fused kernel (cpu)")
    line = fast_paths.describe_fast_paths(device="cpu", params_dtype=torch.float32, compile=False, chunk_setting=None,
                                          vocab_per_rank=256, normalization="LayerNorm", fused_adamw=False)
    assert "compile off (eager)" in line and "cross entropy whole micro-batch" in line and "F.layer_norm" in line


# --- host synchronizations (the device check's counter) ------------------------------------------
def test_host_sync_counter_counts_the_warnings_of_the_sync_debug_mode(monkeypatch):
    import warnings

    from megatron_lite.training.profiling import HostSyncCounter

    monkeypatch.setenv("MEGATRON_LITE_SYNC_DEBUG_FROM", "2")
    assert HostSyncCounter(torch.device("cpu")).start is None  # CUDA only
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    counter = HostSyncCounter(torch.device("cuda"))  # built without touching a GPU
    with counter.step(1):
        warnings.warn("called a synchronizing CUDA operation")
    assert counter.fields() == {} and modes == []  # before the first counted step
    with counter.step(2):
        warnings.warn("called a synchronizing CUDA operation")  # e.g. the logged loss
        warnings.warn("something else")
        warnings.warn("called a synchronizing CUDA operation")
    fields = counter.fields()
    assert fields["host_syncs"] == 2 and modes == ["warn", "default"]
    assert fields["host_sync_sites"] and all(site.startswith("test_fast_paths.py:") for site in fields["host_sync_sites"])
