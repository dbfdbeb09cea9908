"""The planner against runs others published (tests/published_runs.py), with one set of hardware
constants (planning/hardware.py, sources there): Megatron-LM's 2024 GPT table and torchtitan's
Llama-3.1-8B FSDP run are accepted by the trainer's rules, fit, and are predicted within 20 % of
their published throughput; DeepSeek-V3 and Kimi-K2 at their published layouts are accepted and
fit. And the pieces that prediction rests on: collectives priced by where their group's ranks sit
(an all-to-all inside a node at NVLink's rate, across nodes at the NIC's; a ring over k ranks a
node at k NICs' rate), and the GPU record overridable from the command line and a JSON file."""
import json

import pytest

from megatron_lite.planning.hardware import GPUS, all_to_all_seconds, ranks_per_node, ring_seconds
from tests.published_runs import LAYOUTS, RUNS


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_published_run_fits_and_is_predicted_within_20_percent(run, tmp_path):
    ev, hw = run.plan(str(tmp_path))
    assert ev.valid, ev.error
    predicted = run.predicted(ev)
    print(f"{run.name}: published {run.published:,.1f}, predicted {predicted:,.1f} "
          f"({predicted / run.published - 1:+.1%}), peak {ev.peak_bytes / 2**30:.1f} GiB "
          f"of {hw.usable_bytes / 2**30:.1f}")
    assert ev.fits, (ev.peak_bytes, ev.usable)
    assert abs(predicted / run.published - 1) <= 0.20, (predicted, run.published)


@pytest.mark.parametrize("run", LAYOUTS, ids=lambda r: r.name)
def test_published_moe_layout_is_accepted_and_fits(run, tmp_path):
    ev, hw = run.plan(str(tmp_path))
    assert ev.valid, ev.error
    assert ev.fits, (ev.peak_bytes, ev.usable)
    t = ev.time
    assert t.ep_s > 0 and t.bubble_s > 0 and t.compute_s > 0  # the all-to-all and the pipeline are priced


def test_collectives_are_priced_by_where_their_ranks_sit():
    hw = GPUS["H100"]  # 8 GPUs a node, NVLink 360 GB/s, one 45 GB/s NIC per GPU
    nbytes = 1e9
    # EP8 over consecutive ranks: one node, all of it over NVLink; EP16: half the bytes leave the node.
    assert all_to_all_seconds(hw, nbytes, 8, 1) == pytest.approx(nbytes * 7 / 8 / 360e9)
    assert all_to_all_seconds(hw, nbytes, 16, 1) == pytest.approx(nbytes * 8 / 16 / 45e9)
    # EP8 at expert-TP 2 spans two nodes: 4 ranks a node, 3/8 inside, 4/8 outside.
    assert ranks_per_node(hw, 8, 2) == 4
    assert all_to_all_seconds(hw, nbytes, 8, 2) == pytest.approx(nbytes * 4 / 8 / 45e9)
    # A DP ring next to TP8 has one rank a node (one NIC); next to TP2, four (four NICs); inside a node, NVLink.
    assert ring_seconds(hw, nbytes, 48, 8) == pytest.approx(nbytes / 45e9)
    assert ring_seconds(hw, nbytes, 48, 2) == pytest.approx(nbytes / 180e9)
    assert ring_seconds(hw, nbytes, 48, 1) == pytest.approx(nbytes / 360e9)  # 8 NICs: capped at NVLink's
    assert ring_seconds(hw, nbytes, 4, 2) == pytest.approx(nbytes / 360e9)


def test_expert_all_to_all_at_nvlink_speed_inside_a_node_and_the_nic_speed_across():
    """Mixtral-8x7B at EP8 on 8 GPUs: 8 GPUs a node put the EP group in one node; 4 a node
    (--gpus-per-node, the planner's input) split it over two, half of each rank's bytes on its NIC."""
    from tools.plan import plan_of

    flags = ["--model", "mixtral-8x7b", "--bf16", "--seq-length", "4096", "--micro-batch-size", "1",
             "--global-batch-size", "64", "--expert-model-parallel-size", "8", "--use-distributed-optimizer",
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
             "--world-size", "8"]
    inside, _ = plan_of(flags)
    across, _ = plan_of(flags + ["--gpus-per-node", "4"])
    assert inside.valid and across.valid, (inside.error, across.error)
    # dispatch and combine, forward and backward, of 4096 tokens x top-2 x h 4096 in bf16, 32 layers x 8 micro-batches
    rows = 2 * 4096 * 2 * 4096
    assert inside.time.ep_s == pytest.approx(4 * 32 * 8 * rows * 7 / 8 / 360e9)
    assert across.time.ep_s == pytest.approx(4 * 32 * 8 * rows * 4 / 8 / 45e9)
    assert inside.time.compute_s == across.time.compute_s


def test_the_gpu_record_can_be_overridden(tmp_path, capsys):
    from tools import plan

    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"gemm_tflops": 350.0, "attention_tflops": 200.0}))
    flags = ["--model", "llama3-8b", "--world-size", "8", "--json"]
    assert plan.main(flags) in (0, 1)
    base = json.loads(capsys.readouterr().out)["plan"]["time"]
    assert plan.main(flags + ["--hardware-file", str(path)]) in (0, 1)
    slow = json.loads(capsys.readouterr().out)["plan"]["time"]
    assert plan.main(flags + ["--gemm-tflops", "350", "--attention-tflops", "200"]) in (0, 1)
    flagged = json.loads(capsys.readouterr().out)["plan"]["time"]
    assert slow == flagged
    # GEMM math takes twice as long; its operand traffic and the memory-bound work do not change
    assert slow["detail"]["memory_bound_s"] == base["detail"]["memory_bound_s"]
    assert slow["detail"]["attention_core_s"] == pytest.approx(2 * base["detail"]["attention_core_s"])
    assert base["detail"]["gemm_s"] < slow["detail"]["gemm_s"] < 2 * base["detail"]["gemm_s"]
    path.write_text(json.dumps({"gemm_tflop": 350.0}))
    assert plan.main(flags + ["--hardware-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --hardware-file {path}: unknown fields ['gemm_tflop']; use some of: name, ")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("model", ["llama3-8b", "deepseek-v3", "qwen3-30b-a3b", "gpt-oss-20b"])
def test_gemm_shapes_cover_the_weights_the_layer_types_count(model):
    """The planner's GEMM shapes (what their operand traffic is priced from) hold, per token, the
    weights each layer kind reports using (transformer/counts.py, MLA's from transformer/mla.py):
    standard and multi-latent attention, dense MLP, routed and shared experts; the rest a layer
    counts is its norms, router and biases."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.planning.layout import Layout
    from megatron_lite.planning.timing import gemm_shapes
    from megatron_lite.transformer.model_counts import MicroBatch, layer_counts
    from models.zoo import zoo

    cfg = parse_args(["--model", model, "--bf16"], zoo()).model
    lay = Layout(seq_length=4096, global_batch_size=1)
    for moe in sorted(set(cfg.moe_layers())):
        used = layer_counts(cfg, MicroBatch(seq_length=4096), moe).active
        shaped = sum(c * m * k * n for m, k, n, c in gemm_shapes(cfg, lay, moe)) / 4096
        rest = used - shaped
        assert 0 <= rest <= 0.01 * used, (model, moe, used, shaped)


def test_multi_token_prediction_adds_its_module_to_the_last_stage():
    """DeepSeek-V3 at PP16: --mtp-num-layers 1 adds an MoE layer, the 2h -> h projection and an
    output GEMM to the last pipeline stage, the busiest, and its FLOPs to the MFU numerator."""
    from megatron_lite.arguments import parse_args
    from megatron_lite.planning.hardware import GPUS
    from megatron_lite.planning.layout import Layout
    from megatron_lite.planning.timing import model_work
    from megatron_lite.transformer.model_counts import MicroBatch, model_counts
    from models.zoo import zoo

    plain = parse_args(["--model", "deepseek-v3", "--bf16"], zoo()).model
    mtp = parse_args(["--model", "deepseek-v3", "--bf16", "--mtp-num-layers", "1"], zoo()).model
    lay, hw = Layout(pp=16, seq_length=4096, global_batch_size=16), GPUS["H800"]
    (layers0, last0), (layers1, last1) = model_work(plain, lay, hw), model_work(mtp, lay, hw)
    assert layers0 == layers1
    counts = model_counts(mtp, MicroBatch(seq_length=4096))
    moe_layer = layers1[-1]
    assert counts.mtp.flops > counts.layers[-1].flops + counts.output.flops  # the layer, projection, output GEMM
    assert last1.total > last0.total + moe_layer.total  # the layer and an output GEMM's worth more
    assert last1.total < last0.total * 2 + moe_layer.total * 1.5


def test_zero3_gathers_and_reduce_scatters_share_the_link():
    """Llama-3 8B, ZeRO-3 over 8 GPUs of a node, 2 micro-batches: each micro-batch's parameter
    gathers (forward and backward) and gradient reduce-scatter hide behind compute while all of
    them together fit under it; past that, the step waits for the remainder."""
    import torch

    from megatron_lite.arguments import parse_args
    from megatron_lite.planning.layout import Layout
    from megatron_lite.planning.timing import step_time
    from models.gpt_inventory import GPTInventory
    from models.zoo import zoo

    cfg = parse_args(["--model", "llama3-8b", "--bf16"], zoo()).model
    inventory = GPTInventory(cfg, torch.bfloat16).chunk
    lay = Layout(dp=8, zero_stage=3, seq_length=8192, global_batch_size=16, overlap_grad_reduce=True,
                 overlap_param_gather=True)
    fast = step_time(cfg, lay, GPUS["H100"].with_(nvlink_gbps=80.0), inventory)
    slow = step_time(cfg, lay, GPUS["H100"].with_(nvlink_gbps=40.0), inventory)
    assert fast.compute_s == slow.compute_s
    assert fast.detail["dp_comm_s"] < fast.compute_s and fast.dp_s < 0.05 * fast.detail["dp_comm_s"]
    assert slow.detail["dp_comm_s"] > slow.compute_s
    assert slow.dp_s == pytest.approx(slow.detail["dp_comm_s"] - slow.compute_s)
