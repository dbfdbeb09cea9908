"""Shared helpers for tests that run the real training loop (in forked ranks or via torchrun)."""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "5", "--device", "cpu",
        "--lr", "3e-3", "--eval-iters", "0", "--attention-dropout", "0", "--hidden-dropout", "0"]  # on the built-in corpus (Python sources, byte tokenizer)
LLAMA_SWITCHES = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
                  "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention",
                  "--num-query-groups", "2"]


def train_in_process(rank, world, argv):
    """Run pretrain_gpt's Trainer on this forked rank; returns its per-iteration records."""
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    cfg, tokenizer = resolve(argv)
    return make_trainer(cfg, tokenizer, torch.device("cpu")).train()


def straight_and_resumed(argv, world, ckpt, at=3):
    """Losses of the uninterrupted run of `argv` on `world` forked ranks, and of the same run saved
    to `ckpt` and stopped at iteration `at`, then resumed from there."""
    from megatron_lite.testing import run_distributed

    def run(extra):
        return losses_of(run_distributed(train_in_process, world, argv + extra))

    straight = run([])
    first = run(["--save", str(ckpt), "--exit-interval", str(at)])
    return straight, first + run(["--save", str(ckpt), "--load", str(ckpt)])


def losses_of(histories):
    """lm_loss per iteration from whichever rank logged it (the last pipeline stage)."""
    for h in histories:
        if h and h[0]["lm_loss"] is not None:
            return [r["lm_loss"] for r in h]
    raise AssertionError("no rank reported lm_loss")


def torchrun_command(nproc, args, metrics_path, launcher=()):
    """The torchrun command line of pretrain_gpt.py; `launcher`: extra torchrun flags."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", *launcher,
            os.path.join(ROOT, "pretrain_gpt.py"), *args, "--metrics-file", str(metrics_path)]


def torchrun(nproc, args, metrics_path, timeout=300, check=True, launcher=(), env=None):
    cmd = torchrun_command(nproc, args, metrics_path, launcher)
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_and_gather(rank, world, argv, trace=False):
    """Like train_in_process, but also returns this rank's final full (TP-gathered) parameters by
    their global names, and the pipeline actions it executed when `trace`."""
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    from megatron_lite.parallel.sharding import gather_full, spec_of
    cfg, tokenizer = resolve(argv)
    trainer = make_trainer(cfg, tokenizer, torch.device("cpu"))
    executor = getattr(trainer.forward_backward, "executor", None)
    if trace and executor is not None:
        executor.trace = []
    history = trainer.train()
    params = {}
    with trainer.grad_sync.gathered_params():  # ZeRO-3 keeps only shards between steps
        for chunk in trainer.chunks:
            for name, p in chunk.named_parameters():
                if spec_of(p).tie is not None and not chunk.pre_process:
                    continue  # the last stage's copy of the tied embedding
                params[name] = gather_full(p.data, p, trainer.dims).float()
    return history, params, (executor.trace if trace and executor is not None else None), trainer.dims.pp_rank


def reduce_step(sync, chunks, batches):
    """Forward and backward of GPT's forward step on each micro-batch of one step, and the
    GradientSync's reduction of the gradients (no update)."""
    from models.gpt import gpt_forward_step
    sync.start_step(len(batches))
    for batch in batches:
        output, loss_func = gpt_forward_step(batch, chunks[0])
        loss_func(output)[0].backward()
    sync.finish()


_SINGLE = {}


def single_process_reference(argv):
    """(records, final params by global name) of the single-process run of `argv`, run once per
    test session."""
    from megatron_lite.testing import run_distributed
    key = tuple(argv)
    if key not in _SINGLE:
        results = run_distributed(train_and_gather, 1, list(argv))
        _SINGLE[key] = records_of([r[0] for r in results]), merged_params(results)
    return _SINGLE[key]


def assert_layout_like_single(argv, world, extra, model_flags=("--num-layers", "--global-batch-size")):
    """`argv + extra` on `world` forked ranks trains like the single process of `argv` (the flags in
    `model_flags` taken from `extra` too: the same model and batch): losses to 1e-5, the first grad
    norm to 1e-6; the final weights to 1e-4 (5 Adam steps)."""
    from megatron_lite.testing import assert_same_run, run_distributed
    for flag in model_flags:
        if flag in extra:
            argv = argv + [flag, extra[extra.index(flag) + 1]]
    ref, ref_params = single_process_reference(argv)
    results = run_distributed(train_and_gather, world, argv + extra)
    got = records_of([r[0] for r in results])
    assert_same_run(ref, got, grad_norm_rtol=1e-6, what=" ".join(extra))
    assert_same_run(ref, got, rtol=1e-4, params=merged_params(results), ref_params=ref_params, what=" ".join(extra))


def merged_params(results):
    out = {}
    for _, params, _, _ in results:
        for k, v in params.items():
            out.setdefault(k, v)
    return out


def records_of(histories):
    """The per-iteration records of whichever rank logged the loss (the last pipeline stage)."""
    for h in histories:
        if h and h[0]["lm_loss"] is not None:
            return h
    raise AssertionError("no rank reported lm_loss")


def assert_conversions_refuse(cfg, hf_match, megatron_match):
    """Hugging Face and Megatron-LM conversion of a model config refuse it with one line each
    (messages matching the patterns), rather than drop what they cannot carry."""
    import pytest
    from models.hf_conversion import ConversionError
    from models.hf_families import family_of
    from models.megatron_conversion import megatron_args_of_config
    with pytest.raises(ConversionError, match=hf_match):
        family_of(cfg)
    with pytest.raises(ConversionError, match=megatron_match):
        megatron_args_of_config(cfg, 1, 1)


def assert_one_line_error(argv, fragment, monkeypatch, capsys, world=1):
    """pretrain_gpt refuses `argv` (rank 0 of `world`) with exit code 2 and one `error:` line containing `fragment`."""
    import pretrain_gpt
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err, err

def logits_of_checkpoint(ckpt, tokens):
    """(single-process logits [b, s, padded vocab] of a converted training checkpoint's full weights on
    `tokens`, its model config, those full weights)."""
    from megatron_lite.checkpoint.offline import full_weights, open_checkpoint
    from megatron_lite.config import ModelConfig
    from megatron_lite.parallel.state import ParallelDims
    from models.gpt import build_model
    from models.hf_conversion import load_full_state_dict_into_model

    with open_checkpoint(str(ckpt)) as reader:
        cfg = ModelConfig(**reader.meta["model_config"])
        state = full_weights(reader, fp32_from_main=False)
    dims = ParallelDims()
    model = build_model(cfg, dims)[0].eval()
    load_full_state_dict_into_model(model, state, dims)
    with torch.no_grad():
        return model(tokens), cfg, state
