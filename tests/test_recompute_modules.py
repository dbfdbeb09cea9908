"""Megatron's --recompute-modules (selective recomputation) and --cpu-offloading reproduce the run
that keeps every activation: losses, grad norms and final parameters (fp32), for each module on
the models that have it (dense Llama-style, MoE with a shared expert, MLA), one parallel cell each
(TP2 + SP for the modules, PP2 1F1B for offloading); and what a layer keeps for backward shrinks as
the planner's layer counts say (saved-tensor hooks, bf16, within 10 %)."""
import pytest

from megatron_lite.testing import assert_same_run, run_distributed
from tests.planner_harness import LAYER_MODELS, saved_per_layer
from training_utils import LLAMA_SWITCHES, TINY, merged_params, records_of, train_and_gather

LLAMA = TINY + LLAMA_SWITCHES
MOE = LLAMA + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-shared-expert-intermediate-size", "32",
               "--moe-aux-loss-coeff", "1e-2"]
MLA = TINY + ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
              "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--multi-latent-attention",
              "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "12", "--qk-pos-emb-head-dim", "8",
              "--v-head-dim", "20"]
SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules"]
OFFLOAD = ["--cpu-offloading", "--cpu-offloading-num-layers", "1"]
# model -> the variants checked against its plain run in one forked process
VARIANTS = {
    "llama": [SELECTIVE + ["mlp"], SELECTIVE + ["layernorm"], SELECTIVE + ["core_attn", "mlp", "layernorm"], OFFLOAD],
    "moe": [SELECTIVE + ["moe_act"], SELECTIVE + ["shared_experts", "layernorm"], SELECTIVE + ["moe", "layernorm"],
            OFFLOAD],
    "mla": [SELECTIVE + ["mla_up_proj"], SELECTIVE + ["mla_up_proj", "core_attn", "layernorm"]],
}
MODELS = {"llama": LLAMA, "moe": MOE, "mla": MLA}


def _train_each(rank, world, argvs):
    return [train_and_gather(rank, world, argv) for argv in argvs]


@pytest.mark.parametrize("model", ["llama", pytest.param("moe", marks=pytest.mark.slow),
                                   pytest.param("mla", marks=pytest.mark.slow)])
def test_each_recompute_module_and_offloading_match_the_plain_run(model):
    base = MODELS[model]
    runs = run_distributed(_train_each, 1, [base] + [base + v for v in VARIANTS[model]])[0]
    ref, ref_params = records_of([runs[0][0]]), runs[0][1]
    for extra, (history, params, _, _) in zip(VARIANTS[model], runs[1:]):
        assert_same_run(ref, history, rtol=1e-5, grad_norm_rtol=1e-6, params=params, ref_params=ref_params,
                        what=f"{model} {' '.join(extra)}")


FOUR = ["--num-layers", "4", "--global-batch-size", "8", "--cpu-offloading", "--cpu-offloading-num-layers", "3"]


@pytest.mark.parametrize("extra,world", [
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"] + SELECTIVE + ["core_attn", "mlp", "layernorm"], 2),
    (["--pipeline-model-parallel-size", "2"] + FOUR, 2),
    pytest.param(["--zero-stage", "3"] + FOUR, 2, marks=pytest.mark.slow),
    pytest.param(["--tensor-model-parallel-size", "2", "--sequence-parallel"] + FOUR, 2, marks=pytest.mark.slow),
    pytest.param(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"] + FOUR, 2,
                 marks=pytest.mark.slow),
    pytest.param(["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"] + FOUR, 2,
                 marks=pytest.mark.slow)],
    ids=["tp2-sp-modules", "pp2-offload", "zero3-offload", "tp2-sp-offload", "interleaved-offload", "zb-h1-offload"])
def test_parallel_cell_matches_the_plain_single_process_run(extra, world):
    shape = [a for flag in ("--num-layers", "--global-batch-size") if flag in extra
             for a in (flag, extra[extra.index(flag) + 1])]
    ref = run_distributed(train_and_gather, 1, LLAMA + shape)
    got = run_distributed(train_and_gather, world, LLAMA + extra)
    assert_same_run(records_of([r[0] for r in ref]), records_of([r[0] for r in got]), rtol=1e-5,
                    grad_norm_rtol=1e-6, params=merged_params(got), ref_params=merged_params(ref),
                    what=" ".join(extra))


def test_saved_bytes_per_layer_shrink_as_the_planner_counts():
    llama = LAYER_MODELS["Llama"]
    cells = [[], SELECTIVE + ["mlp"], SELECTIVE + ["layernorm"], SELECTIVE + ["core_attn", "layernorm"]]
    got = run_distributed(saved_per_layer, 1, [llama + c for c in cells])[0]
    plain = got[0]["measured"]
    for extra, g in zip(cells, got):
        assert abs(g["planner"] / g["measured"] - 1) < 0.10, (extra, g)
    assert got[1]["measured"] < 0.75 * plain  # the MLP keeps only its input (the norm's output)
    # layernorm: both norms' outputs (2 a h a token) are recomputed, not kept
    assert plain - got[2]["measured"] == 2 * 2 * got[0]["sbh"]


@pytest.mark.slow
def test_compiled_layers_with_recompute_modules_and_offloading_match_compiled_plain():
    """--compile with output-discarding recomputation and with offloading (the host copies keep the
    saved tensors' strides, which compiled backward kernels check)."""
    base = LLAMA + ["--train-iters", "2", "--compile"]
    variants = [SELECTIVE + ["layernorm", "mlp"], OFFLOAD]
    runs = run_distributed(_train_each, 1, [base] + [base + v for v in variants], timeout=900)[0]
    for extra, (history, params, _, _) in zip(variants, runs[1:]):
        assert_same_run(records_of([runs[0][0]]), history, rtol=1e-5, params=params, ref_params=runs[0][1],
                        what=f"compiled {' '.join(extra)}")
