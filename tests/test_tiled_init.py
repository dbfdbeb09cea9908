"""Tiled initialization: every layout's shards, gathered, equal the TP=1 weights exactly
(TP 2/4/8 with [Q|K|V] and [gate|up] segments, replicated K/V, padded vocabularies; EP with and
without expert TP; ZeRO-3 flat shards filled straight from the tiles), with tiles small enough
that every cut crosses tile boundaries. Plus: meta construction allocates only the rank's shard
(a llama3-70b-shaped model at TP=8, in a fresh process), buffers come out as a CPU build makes them."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.optim.optimizer import build_optimizer
from megatron_lite.config import ParallelConfig, TrainingConfig
from megatron_lite.parallel.sharding import spec_of
from megatron_lite.parallel.state import ParallelDims
from megatron_lite.parallel.tiled_init import TiledInit, flat_boxes, materialize_, tiles_meeting
from megatron_lite.testing import run_distributed
from megatron_lite.transformer.spec import BuildContext
from models.gpt import GPTModel, build_model, weight_init

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 8 heads over 2 K/V groups (replicated on 2 and 4 ranks at TP 4 and 8), SwiGLU [gate | up], a
# vocabulary that TP pads differently, untied output layer.
LLAMA = dict(num_layers=2, hidden_size=48, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=80,
             vocab_size=203, make_vocab_size_divisible_by=8, normalization="RMSNorm", position_embedding_type="rope",
             swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True)
MOE = dict(LLAMA, moe=dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_router_enable_expert_bias=True,
                           moe_router_score_function="sigmoid", moe_shared_expert_intermediate_size=16))
SMALL_TILES = dict(rows=5, cols=7)  # awkward on purpose: no cut lines up with a tile edge


def _init(cfg: ModelConfig, seed: int = 3) -> TiledInit:
    base = weight_init(cfg, seed)
    return TiledInit(seed, base.stds, **SMALL_TILES)


def _rank_weights(cfg: ModelConfig, dims: ParallelDims, init: TiledInit):
    """{name: (local tensor, spec)} of one rank, built on meta and materialized (no process group)."""
    with torch.device("meta"):
        model = GPTModel(cfg, _ctx(dims))
    materialize_(model, init, "cpu")
    return {n: (p.detach(), spec_of(p)) for n, p in model.named_parameters()}


def _ctx(dims):
    return BuildContext(dims)


def _full(pieces, spec, axis="tp"):
    return spec.trim(spec.unshard(pieces, axis))


def test_tiles_and_flat_boxes_cover_exactly():
    shape, ext = (11, 9), (4, 5)
    box = ((2, 7), (3, 6))
    covered = torch.zeros(shape, dtype=torch.int32)
    for _, (r, c) in tiles_meeting(shape, ext, box):
        covered[r[0]:r[0] + r[1], c[0]:c[0] + c[1]] += 1
    assert covered.max() == 1 and covered[2:9, 3:9].min() == 1  # each tile once, the box covered
    t = torch.arange(3 * 4 * 5).view(3, 4, 5)
    for lo, hi in ((0, 60), (7, 53), (21, 22), (0, 20), (19, 41)):
        pieces = [t[tuple(slice(s, s + n) for s, n in box)].reshape(-1) for _, box in flat_boxes(t.shape, lo, hi)]
        assert torch.equal(torch.cat(pieces), t.reshape(-1)[lo:hi])


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_shards_gather_to_the_tp1_weights(tp):
    cfg = ModelConfig(**LLAMA)
    init = _init(cfg)
    ref = _rank_weights(cfg, ParallelDims(), init)
    ranks = [_rank_weights(cfg, ParallelDims(tp=tp, rank=r), init) for r in range(tp)]
    for name, (full, spec) in ref.items():
        got = _full([w[name][0] for w in ranks], ranks[0][name][1])
        assert torch.equal(got, spec.trim(full)), name
    emb = ranks[-1]["embedding.word_embeddings.weight"]
    assert emb[1].stored_rows < emb[1].full_shape[0] and emb[0][-1].abs().sum() == 0  # padding rows are zero


@pytest.mark.parametrize("ep,tp,etp", [(2, 1, 1), (4, 1, 1), (2, 2, 2)])
def test_expert_shards_gather_to_the_ep1_weights(ep, tp, etp):
    cfg = ModelConfig(**MOE)
    init = _init(cfg)
    ref = _rank_weights(cfg, ParallelDims(), init)
    grid = {}  # (ep_rank, tp_rank) -> weights
    dims_all = [ParallelDims(tp=tp, dp=ep, ep=ep, etp=etp, rank=r) for r in range(tp * ep)]
    for d in dims_all:
        grid[(d.ep_rank, d.tp_rank)] = _rank_weights(cfg, d, init)
    for name, (full, spec) in ref.items():
        per_ep = []
        for e in range(ep):
            pieces = [grid[(e, t)][name] for t in range(tp)]
            per_ep.append(_full([p for p, _ in pieces], pieces[0][1]))
        s = grid[(0, 0)][name][1].split("ep")
        got = torch.cat(per_ep, dim=s.dim) if s is not None else per_ep[0]
        assert torch.equal(got, spec.trim(full)), name


def test_flat_ranges_of_a_local_tensor_are_its_elements():
    """What a ZeRO-3 shard draws: any flat range of a TP-local tensor, padding rows included."""
    cfg = ModelConfig(**LLAMA)
    init = _init(cfg)
    local = _rank_weights(cfg, ParallelDims(tp=4, rank=3), init)
    for name in ("embedding.word_embeddings.weight", "layers.1.self_attention.linear_kv.weight",
                 "layers.0.mlp.linear_fc2.weight"):
        t, spec = local[name]
        flat = t.reshape(-1)
        cuts = [0, 13, 14, 97, flat.numel() // 2 + 5, flat.numel()]
        for lo, hi in zip(cuts, cuts[1:]):
            out = torch.full((hi - lo,), float("nan"))
            init.fill_local(out, spec, name, lo)
            assert torch.equal(out, flat[lo:hi]), (name, lo, hi)


def _zero3_params(rank, world, tp, stage):
    """Built with parameters left on meta: GradientSync draws only its (ZeRO-3) shard."""
    dims = ParallelDims.from_world(tp=tp)
    cfg = ModelConfig(**LLAMA)
    chunks = build_model(cfg, dims, seed=3, materialize=False)
    assert all(p.is_meta for p in chunks[0].parameters())
    _, sync = build_optimizer(chunks, dims, TrainingConfig(), ParallelConfig(tensor_model_parallel_size=tp,
                                                                              zero_stage=stage, ddp_bucket_size=3000))
    with sync.gathered_params():
        return {n: (p.detach().clone(), spec_of(p)) for n, p in chunks[0].named_parameters()}


def test_zero3_shards_drawn_in_place_gather_to_the_tp1_weights():
    ref = {n: p.detach() for n, p in build_model(ModelConfig(**LLAMA), ParallelDims(), seed=3)[0].named_parameters()}
    for tp, stage in ((1, 3), (2, 3), (2, 1)):
        out = run_distributed(_zero3_params, 4, tp, stage)
        for name, full in ref.items():
            pieces = [out[r][name] for r in range(tp)]
            spec = pieces[0][1]
            assert torch.equal(_full([p for p, _ in pieces], spec), full[: spec.stored_rows]), (tp, stage, name)


def test_build_model_default_tiles_match_across_tp_and_cpu_built_buffers():
    cfg = ModelConfig(**MOE)
    ref = build_model(cfg, _ctx(ParallelDims()), seed=9)[0]
    pieces = [build_model(cfg, _ctx(ParallelDims(tp=2, rank=r)), seed=9)[0] for r in range(2)]
    for (name, p), *others in zip(ref.named_parameters(), *[m.named_parameters() for m in pieces]):
        assert torch.equal(_full([q.detach() for _, q in others], spec_of(others[0][1])), spec_of(p).trim(p.detach()))
    cpu_built = GPTModel(cfg, _ctx(ParallelDims()))  # buffers as a plain build makes them
    for (name, b), (_, ref_b) in zip(ref.named_buffers(), cpu_built.named_buffers()):
        assert b.device.type == "cpu" and torch.equal(b, ref_b), name
    other = build_model(cfg, _ctx(ParallelDims()), seed=10)[0]
    assert not torch.equal(other.layers["0"].mlp.experts.weight1, ref.layers["0"].mlp.experts.weight1)


def test_llama3_70b_shape_at_tp8_allocates_only_its_shard():
    """A fresh process builds 2 llama3-70b layers (with the 128256-row embedding and output layer)
    at TP=8 as rank 5, bf16: its peak resident memory grows by at most 1.1x its shard's bytes."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_init.py"), "--child",
                          "--model", "llama3-70b", "--tp", "8", "--rank", "5"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nllama3-70b x 2 layers, TP=8 rank 5: shard {r['shard_bytes'] / 2**20:.0f} MiB, peak RSS growth "
          f"{r['peak_growth_bytes'] / 2**20:.0f} MiB ({r['peak_growth_bytes'] / r['shard_bytes']:.3f}x), "
          f"built in {r['build_s']:.2f} s")
    assert r["peak_growth_bytes"] <= 1.1 * r["shard_bytes"], r


def test_init_and_offload_flags_reach_the_config():
    from megatron_lite.arguments import parse_args
    from megatron_lite.errors import ConfigError
    from models.zoo import zoo

    cfg = parse_args(["--use-cpu-initialization", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.25"],
                     zoo())
    t = cfg.training
    assert t.use_cpu_initialization and t.optimizer_cpu_offload and t.optimizer_offload_fraction == 0.25
    t.optimizer_offload_fraction = 1.5
    with pytest.raises(ConfigError, match="offload-fraction"):
        cfg.finalize(1).validate(1)
    on_cpu = build_model(ModelConfig(**LLAMA), ParallelDims(), seed=3, cpu_initialization=True)[0]
    default = build_model(ModelConfig(**LLAMA), ParallelDims(), seed=3)[0]
    for (name, p), (_, q) in zip(on_cpu.named_parameters(), default.named_parameters()):
        assert torch.equal(p, q), name  # on a CPU run the CPU draws are the device's
