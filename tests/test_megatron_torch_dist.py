"""Megatron-LM's torch_dist checkpoints as a training format: a run Megatron-Core started continues here.

The oracle is Megatron-Core 0.16.1 training on the CPU (tests/mcore_cpu.py): a tiny Llama-like GPT
(RMSNorm, RoPE, SwiGLU, 2 query groups for 4 heads, untied output; NullTokenizer's 200 ids padded to
256 rows) at TP2, wrapped in its DistributedDataParallel, stepped by its own optimizer (Adam with
weight decay, gradient clipping) and OptimizerParamScheduler (cosine decay), on the samples of our
--mock-data run. It trains 3 iterations and saves as Megatron-LM's save_checkpoint does (model and
optimizer sharded state dicts through dist_checkpointing.save, the scheduler's state, the args with
the consumed samples), then trains 3 more and saves again. megatron-lite resumes from the first
checkpoint (--auto-detect-ckpt-format) at TP2, TP1, DP2 and PP2: its next 3 losses are Megatron-
Core's, and its Adam moments after them are those Megatron-Core saved at iteration 6. Likewise from
Megatron-Core's distributed optimizer (TP2 x DP2, saved fully_reshardable) and from an MoE model.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mcore_cpu import import_mcore  # noqa: E402  (first: before any other megatron.core import)

if import_mcore() is None:
    pytest.skip("megatron-core is not installed (pip install megatron-core==0.16.1)", allow_module_level=True)

import mcore_cpu  # noqa: E402
from megatron_lite.checkpoint.offline import open_checkpoint  # noqa: E402
from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.data.gpt_dataset import MockGPTDataset, SampleOptions  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402
from training_utils import losses_of, train_in_process  # noqa: E402

SEQ, BATCH, SEED, SAVED_AT, ITERS = 16, 4, 1234, 3, 6
PADDED, TOKENS = 256, 199  # NullTokenizer --vocab-size 199: ids 0..198 and its end of document
LR, MIN_LR, WD, CLIP = 3e-3, 3e-4, 0.1, 0.5
SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
             max_position_embeddings=32, norm_epsilon=1e-5, normalization="RMSNorm", position_embedding_type="rope",
             swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True)

# 4 experts (SequentialMLP), top-2 of sigmoid scores with an expert bias (aux-loss-free balancing,
# updated once per step as Megatron-LM's finalize_model_grads does); dense and MoE layers mixed:
# Megatron-Core stores them per layer
MOE_SHAPE = dict(SHAPE, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=[0, 1],
                 moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)


def _batches():
    """The global batches of our --mock-data run, in order: (tokens, labels, loss mask) [BATCH, SEQ]."""
    data = MockGPTDataset(TOKENS + 1, SEQ, ITERS * BATCH, SEED, SampleOptions(eod=TOKENS))
    for it in range(ITERS):
        samples = [data[i] for i in range(it * BATCH, (it + 1) * BATCH)]
        yield tuple(torch.stack([s[k] for s in samples]) for k in ("tokens", "labels", "loss_mask"))


def _save(model, optimizer, scheduler, args, root: str, iteration: int, sharding: str = "fully_reshardable") -> None:
    """Megatron-LM's save_checkpoint in torch_dist: model and optimizer sharded state dicts (the
    distributed optimizer's in the `sharding` layout), the scheduler's state, the args (consumed
    samples in them), iteration and version; the tracker."""
    from megatron.core import dist_checkpointing

    args.iteration, args.consumed_train_samples = iteration, iteration * BATCH
    path = os.path.join(root, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(metadata={"singleton_local_shards": False})}
    optim = optimizer.sharded_state_dict(state, metadata={"distrib_optim_sharding_type": sharding})
    state.update(optimizer=optim, opt_param_scheduler=scheduler.state_dict(),
                 args=args, checkpoint_version=3.0, iteration=iteration, num_floating_point_operations_so_far=0)
    dist_checkpointing.save(state, path)
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()


def _megatron_trains(rank, world, root, shape, tp):
    """One rank of Megatron-Core at TP `tp` (x DP2: with its distributed optimizer): 6 iterations,
    saved after 3 and after 6; its losses."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    mcore_cpu.cpu_shims()
    dp = world // tp
    distributed = dp > 1
    if distributed:  # its distributed optimizer checks that the params are CUDA tensors by their type name
        cpu_type = torch.Tensor.type
        torch.Tensor.type = lambda self, *a, **k: cpu_type(self, *a, **k) if a or k else \
            cpu_type(self).replace("torch.", "torch.cuda.", 1)
    model = mcore_cpu.build_gpt(shape, tp, 1, PADDED, parallel_output=True)[0].train()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed),
                                  model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD,
                                                       clip_grad=CLIP, params_dtype=torch.float32,
                                                       use_distributed_optimizer=distributed), [ddp])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=0,
                                        lr_decay_steps=ITERS * BATCH, lr_decay_style="cosine", start_wd=WD,
                                        end_wd=WD, wd_incr_steps=ITERS * BATCH, wd_incr_style="constant")
    args = mcore_cpu.megatron_args(shape, tp, 1, PADDED, "torch_dist")
    args.tokenizer_type, args.vocab_size = "NullTokenizer", TOKENS
    args.global_batch_size, args.seq_length = BATCH, SEQ
    args.use_distributed_optimizer, args.data_parallel_size = distributed, dp
    args.moe_router_bias_update_rate = model.config.moe_router_bias_update_rate
    mb, dp_rank = BATCH // dp, parallel_state.get_data_parallel_rank()
    position = torch.arange(SEQ).unsqueeze(0).expand(mb, -1)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    losses = []
    for it, batch in enumerate(_batches(), start=1):
        tokens, labels, mask = (t[dp_rank * mb:(dp_rank + 1) * mb] for t in batch)  # this DP rank's samples
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        per_token = ddp(tokens, position, causal, labels=labels).float()
        loss = (per_token * mask).sum() / mask.sum()
        loss.backward()
        ddp.finish_grad_sync()  # (the DP mean of the gradients: every rank has as many tokens)
        _update_router_expert_bias([ddp], model.config)
        optimizer.step()
        scheduler.step(increment=BATCH)
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
        losses.append(reported.item() / dp)
        if it in (SAVED_AT, ITERS):
            _save(model, optimizer, scheduler, args, os.path.join(root, f"megatron-{it}"), it)
        if it == SAVED_AT and distributed:  # (Megatron-LM's default layout of the distributed optimizer)
            _save(model, optimizer, scheduler, args, os.path.join(root, "dp-reshardable"), it, "dp_reshardable")
    return losses


def _megatron_run(tmp_path_factory, world: int, shape=SHAPE, tp: int = 2):
    """(Megatron-Core's losses of iterations 1-6, the root of its iteration-3 checkpoint, of its
    iteration-6 one, the directory they lie in)."""
    root = str(tmp_path_factory.mktemp("megatron-torch-dist"))
    losses = run_distributed(_megatron_trains, world, root, shape, tp, daemon=False)[0]
    return losses, os.path.join(root, f"megatron-{SAVED_AT}"), os.path.join(root, f"megatron-{ITERS}"), root


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """Megatron-Core at TP2 with its plain optimizer."""
    return _megatron_run(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def megatron_moe(tmp_path_factory):
    """Megatron-Core with its plain optimizer, an MoE model (layer 0 dense, layer 1 MoE), at TP1 (its
    MoE layers train at TP > 1 only with sequence parallelism)."""
    return _megatron_run(tmp_path_factory, 1, MOE_SHAPE, tp=1)


@pytest.fixture(scope="module")
def megatron_distributed(tmp_path_factory):
    """Megatron-Core at TP2 x DP2 with its distributed optimizer (saved fully_reshardable)."""
    return _megatron_run(tmp_path_factory, 4)


def _resume(load: str, save: str, layout, world: int, *extra):
    run = ["--mock-data", "--vocab-size", str(TOKENS), "--seq-length", str(SEQ), "--global-batch-size", str(BATCH),
           "--train-iters", str(ITERS), "--eval-iters", "0", "--device", "cpu", "--seed", str(SEED),
           "--use-checkpoint-args", "--load", load, "--auto-detect-ckpt-format", "--lr", str(LR),
           "--min-lr", str(MIN_LR), "--lr-decay-style", "cosine", "--lr-decay-iters", str(ITERS),
           "--weight-decay", str(WD), "--clip-grad", str(CLIP), "--save", save, *layout, *extra]
    return losses_of(run_distributed(train_in_process, world, run))


def _adam_moments(megatron_root: str, ours: str):
    """(Megatron-Core's, ours): every Adam moment by our key, full tensors."""
    from models.megatron_torch_dist import TorchDistFormat

    fmt = TorchDistFormat()
    cfg = fmt.run_config(fmt.iteration_dir(megatron_root))["model_config"]
    meta, theirs = fmt.open(fmt.iteration_dir(megatron_root), ModelConfig(**cfg), load_optim=True)
    with open_checkpoint(ours) as reader:
        keys = [k for k in reader.pieces if k.startswith("optim/") and k.endswith(("/exp_avg", "/exp_avg_sq"))]
        return {k: theirs.read_full(k) for k in keys}, {k: reader.read_full(k) for k in keys}, meta


def _assert_same_state(key: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal to float32 roundoff at the tensor's own scale (the second moments are ~1e-8)."""
    scale = theirs.abs().max().item()
    assert scale > 0, key
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{key}: {m}")


LAYOUTS = {"tp2": (["--tensor-model-parallel-size", "2", "--micro-batch-size", "4"], 2),
           "pp2": (["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2"], 2),
           "tp1": (["--micro-batch-size", "4"], 1),
           "dp2": (["--micro-batch-size", "2"], 2)}


@pytest.mark.parametrize("layout", ["tp2", pytest.param("tp1", marks=pytest.mark.slow), "dp2",
                                    pytest.param("pp2", marks=pytest.mark.slow)])
def test_resume_from_megatron_core_continues_its_run(megatron, tmp_path, layout):
    """At the saving layout and resharded: the next losses and the Adam moments after them are Megatron-Core's."""
    losses, saved, final, _ = megatron
    flags, world = LAYOUTS[layout]
    ours = _resume(saved, str(tmp_path / "ours"), flags, world)
    assert len(ours) == ITERS - SAVED_AT
    for a, b in zip(ours, losses[SAVED_AT:]):
        assert a == pytest.approx(b, rel=1e-5), (ours, losses[SAVED_AT:])
    theirs, mine, meta = _adam_moments(final, str(tmp_path / "ours"))
    assert meta["iteration"] == ITERS and meta["optimizer"]["num_updates"] == ITERS
    assert len(mine) == 2 * 17  # (m, v) of the 17 tensors
    for k in mine:
        _assert_same_state(k, mine[k], theirs[k])


def _load_error(capsys, monkeypatch, load: str, *extra) -> str:
    import pretrain_gpt

    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--mock-data", "--vocab-size", str(TOKENS), "--seq-length", str(SEQ), "--micro-batch-size", "4",
            "--train-iters", "4", "--eval-iters", "0", "--device", "cpu", "--load", load, *extra]
    capsys.readouterr()
    assert pretrain_gpt.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_torch_dist_inputs_are_one_line_errors(megatron, tmp_path, capsys, monkeypatch):
    """Not asked for, another model, a tensor missing: one line naming it, exit status 2."""
    import pickle
    import shutil

    saved = megatron[1]
    err = _load_error(capsys, monkeypatch, saved, "--use-checkpoint-args")
    assert f"{saved} is a Megatron-LM torch_dist checkpoint: pass --ckpt-format torch_dist" in err
    shape = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
             "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2"]
    err = _load_error(capsys, monkeypatch, saved, "--ckpt-format", "torch_dist", *shape)
    assert "was written by a different model" in err and "num_layers is 2 there and 3 here" in err, err
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    path = broken / f"iter_{SAVED_AT:07d}" / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    del metadata.state_dict_metadata["optimizer.state.exp_avg.output_layer.weight"]
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    err = _load_error(capsys, monkeypatch, str(broken), "--auto-detect-ckpt-format", "--use-checkpoint-args")
    assert "lacks 1 optimizer state exp_avg tensors this model needs, e.g. output_layer.weight" in err, err


def test_resume_from_megatron_cores_distributed_optimizer(megatron_distributed, tmp_path, capsys, monkeypatch):
    """Its distributed optimizer saved fully_reshardable (Adam moments and fp32 main params per
    parameter) resumes at TP2 x DP2 with ZeRO-1; its default dp_reshardable layout is refused in one line."""
    losses, saved, final, root = megatron_distributed
    ours = _resume(saved, str(tmp_path / "ours"), ["--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                                                    "--use-distributed-optimizer"], 4)
    for a, b in zip(ours, losses[SAVED_AT:]):
        assert a == pytest.approx(b, rel=1e-5), (ours, losses[SAVED_AT:])
    theirs, mine, _ = _adam_moments(final, str(tmp_path / "ours"))
    for k in mine:
        _assert_same_state(k, mine[k], theirs[k])
    err = _load_error(capsys, monkeypatch, os.path.join(root, "dp-reshardable"), "--ckpt-format", "torch_dist",
                      "--use-checkpoint-args")
    assert "saved dp_reshardable" in err and "--dist-ckpt-optim-fully-reshardable" in err, err


def test_resume_from_megatron_core_moe(megatron_moe, tmp_path):
    """An MoE run (its experts' weights and Adam moments by expert, the router's expert bias) saved at
    TP1 continues here at TP2 with Megatron-Core's losses."""
    losses, saved, final, _ = megatron_moe
    ours = _resume(saved, str(tmp_path / "ours"), LAYOUTS["tp2"][0], 2)
    for a, b in zip(ours, losses[SAVED_AT:]):
        assert a == pytest.approx(b, rel=1e-5), (ours, losses[SAVED_AT:])
    theirs, mine, _ = _adam_moments(final, str(tmp_path / "ours"))
    assert any("experts" in k for k in mine)
    for k in mine:
        _assert_same_state(k, mine[k], theirs[k])
