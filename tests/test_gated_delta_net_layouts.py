"""Hybrid models of Gated DeltaNet / Kimi Delta Attention and full-attention layers through the training
loop: every layout trains like the single process (losses 1e-5, first grad norm 1e-6, final weights
1e-4), the loss falls, and the flags' one-line errors."""
import pytest

from megatron_lite.testing import assert_same_run, run_distributed

from training_utils import (LLAMA_SWITCHES, TINY, assert_layout_like_single, assert_one_line_error, merged_params,
                            records_of, single_process_reference, train_and_gather)

LINEAR = ["--experimental-attention-variant", "gated_delta_net", "--linear-num-key-heads", "2",
          "--linear-num-value-heads", "4", "--linear-key-head-dim", "8", "--linear-value-head-dim", "12",
          "--linear-chunk-size", "16", "--linear-conv-kernel-dim", "3"]
QWEN3_NEXT = ["--attention-output-gate", "--qk-layernorm", "--apply-layernorm-1p", "--apply-wd-to-qk-layernorm"]
GDN = TINY + LLAMA_SWITCHES + LINEAR + QWEN3_NEXT + ["--linear-attention-freq", "2"]  # layer 0 linear, 1 full
KDA = TINY + LLAMA_SWITCHES + LINEAR + ["--linear-attention-type", "kda", "--linear-attention-freq", "[1,0,1,1]",
                                        "--num-layers", "4"]


def _shape_flags(extra):
    """The model and batch flags of `extra` that test_mla's helper gives the reference too, in its order."""
    return [x for flag in ("--num-layers", "--global-batch-size") if flag in extra
            for x in (flag, extra[extra.index(flag) + 1])]


TP_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {  # (model, world, extra): the first is the default suite's cell, the rest slow
    "gdn-tp2-sp": (GDN, 2, TP_SP),
    "kda-tp2-sp": (KDA, 2, TP_SP),
    "gdn-pp2-zb-h1": (GDN, 2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
                               "--num-layers", "4"]),
    "kda-pp2-layout": (KDA, 2, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
                                "E,t|t,t,t,L"]),
    "gdn-dp2-zero1": (GDN, 2, ["--zero-stage", "1", "--global-batch-size", "8"]),
    "gdn-dp2-zero2": (GDN, 2, ["--zero-stage", "2", "--global-batch-size", "8"]),
    "gdn-dp2-zero3": (GDN, 2, ["--zero-stage", "3", "--global-batch-size", "8"]),
    "gdn-recompute-full": (GDN, 1, ["--recompute-granularity", "full"]),
    "gdn-recompute-selective": (GDN, 1, ["--recompute-granularity", "selective"]),
    "kda-recompute-linear-attn": (KDA, 1, ["--recompute-granularity", "selective", "--recompute-modules",
                                           "linear_attn", "layernorm"]),
    "gdn-mtp-pp2": (GDN + ["--mtp-num-layers", "1"], 2, ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]),
    "gdn-tp2-sp-pp2": (GDN, 4, TP_SP + ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]),
    "gdn-tp2-dp2-zero3": (GDN, 4, ["--tensor-model-parallel-size", "2", "--zero-stage", "3",
                                   "--global-batch-size", "8"]),
}
FAST = ("gdn-tp2-sp",)


@pytest.mark.parametrize("layout", [name if name in FAST else pytest.param(name, marks=pytest.mark.slow)
                                    for name in LAYOUTS])
def test_hybrid_layout_trains_like_single_process(layout):
    model, world, extra = LAYOUTS[layout]
    assert_layout_like_single(model, world, extra)
    ref = single_process_reference(model + _shape_flags(extra))[0]  # (cached: the run just compared)
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"] - 0.3  # it learns


@pytest.mark.slow
def test_hybrid_fp8_zero_bubble_pp2_equals_the_single_process_fp8_run():
    """FP8 GEMMs (tensorwise e4m3) in the mixers' projections (the GEMM path), their weight gradients
    deferred by zb-h1: as the single-process FP8 run (first step to fp32 rounding, later ones 1e-4, as
    test_mla's FP8 case)."""
    argv = GDN + ["--num-layers", "4", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]
    ref, ref_params = single_process_reference(argv)
    plain, _ = single_process_reference(GDN + ["--num-layers", "4"])
    assert plain[0]["lm_loss"] != ref[0]["lm_loss"]  # FP8 reaches the GEMMs
    results = run_distributed(train_and_gather, 2, argv + ["--pipeline-model-parallel-size", "2",
                                                           "--pipeline-schedule", "zb-h1"])
    assert_same_run(ref, records_of([r[0] for r in results]), rtol=1e-4, grad_norm_rtol=1e-6,
                    params=merged_params(results), ref_params=ref_params)


ERRORS = [  # (argv, world, what the one line says)
    (GDN + ["--tensor-model-parallel-size", "4"], 4, "--linear-num-key-heads (2) must be divisible by "
                                                     "--tensor-model-parallel-size (4)"),
    (KDA + ["--linear-num-key-heads", "3", "--tensor-model-parallel-size", "2"], 2,
     "--linear-num-key-heads (3) must be divisible by --tensor-model-parallel-size (2)"),
    (GDN[:-1] + ["[1,0,1]"], 1, "has 3 entries for 2 layers"),
    (GDN[:-1] + ["[1,2]"], 1, "must be an int or a list of 1 (linear) and 0 (full)"),
    (GDN[:-1] + ["0"], 1, "--linear-attention-freq ('0') must be >= 1"),
    (GDN[:-1] + ["import os"], 1, "--linear-attention-freq 'import os' is not an int or a list"),
    (GDN[:-2], 1, "needs --linear-attention-freq"),
    (GDN + ["--linear-num-value-heads", "3"], 1, "--linear-num-value-heads (3) must be a multiple of "
                                                 "--linear-num-key-heads (2)"),
    (GDN + ["--linear-chunk-size", "0"], 1, "--linear-chunk-size (0) must be >= 1"),
    (GDN + ["--context-parallel-size", "2"], 2, "context parallelism for linear-attention mixers is not built yet"),
    (GDN + ["--linear-attention-type", "mamba"], 1, "invalid choice: 'mamba'"),
    (TINY + ["--experimental-attention-variant", "dsa"], 1, "dsa selects keys for multi-latent attention"),
    (TINY + ["--recompute-granularity", "selective", "--recompute-modules", "linear_attn"], 1,
     "--recompute-modules linear_attn needs linear-attention layers"),
    (TINY + ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--multi-latent-attention",
             "--attention-output-gate"], 1, "it is not built for --multi-latent-attention"),
]


def test_fla_kernel_asked_for_and_missing_is_one_line(monkeypatch, capsys):
    from megatron_lite.kernels.fla_backend import missing_reason
    if missing_reason() is None:
        pytest.skip("flash-linear-attention runs here: nothing is missing")
    assert_one_line_error(GDN + ["--linear-attention-kernel", "fla"], "--linear-attention-kernel fla: "
                          "flash-linear-attention", monkeypatch, capsys)
    from pretrain_gpt import resolve
    resolve(TINY + ["--linear-attention-kernel", "fla"])  # no linear layers: the kernel is not asked for


@pytest.mark.parametrize("argv,world,fragment", ERRORS, ids=[f"e{i}" for i in range(len(ERRORS))])
def test_bad_linear_attention_flags_are_one_line(argv, world, fragment, monkeypatch, capsys):
    assert_one_line_error(argv, fragment, monkeypatch, capsys, world=world)


def _decayed(rank, world, argv):
    """Parameter name -> whether the optimizer decays it."""
    import torch
    from pretrain_gpt import make_trainer, resolve
    trainer = make_trainer(*resolve(argv), torch.device("cpu"))
    return {shard.bucket.names[i]: decays for shard in trainer.optimizer.shards
            for (i, _, _), decays in zip(shard.segment_params, shard.segment_decays)}


def test_apply_wd_to_qk_layernorm_decays_the_q_k_norms_only():
    """Megatron-Core's Qwen3-Next rule: 1-D weights and biases are not decayed, except the q/k norms'
    with --apply-wd-to-qk-layernorm (zero-centred: decayed towards a gain of 1)."""
    without = [a for a in GDN if a != "--apply-wd-to-qk-layernorm"]
    plain, qwen = (run_distributed(_decayed, 1, argv)[0] for argv in (without, GDN))
    norms = [n for n in qwen if "q_layernorm" in n or "k_layernorm" in n]
    assert norms and all(qwen[n] and not plain[n] for n in norms)
    others = [n for n in qwen if n not in norms]
    assert all(qwen[n] == plain[n] for n in others)
    assert not any(qwen[n] for n in others if "norm" in n or n.endswith(("A_log", "dt_bias")))
    assert all(qwen[n] for n in others if n.endswith(("in_proj.weight", "conv1d.weight", "out_proj.weight")))


def test_transformer_engine_backend_refuses_linear_layers():
    """Its layer spec builds standard attention only: a hybrid model is refused, not built as a dense one."""
    import types
    from megatron_lite.config import ModelConfig
    from megatron_lite.errors import ConfigError
    from megatron_lite.transformer import te_backend
    model = ModelConfig(experimental_attention_variant="gated_delta_net", linear_attention_freq=2)
    with pytest.raises(ConfigError, match="--experimental-attention-variant needs --transformer-impl local"):
        te_backend.check_supported(types.SimpleNamespace(model=model, parallel=types.SimpleNamespace(cp=1)))


@pytest.mark.parametrize("kw", [dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=2),
                                dict(attention_output_gate=True)], ids=["linear-layers", "output-gate"])
def test_conversions_refuse_what_they_cannot_carry_yet(kw):
    from megatron_lite.config import ModelConfig
    from training_utils import assert_conversions_refuse
    cfg = ModelConfig(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
                      untie_embeddings_and_output_weights=True, **kw)
    assert_conversions_refuse(cfg, "cannot represent it", "not converted to Megatron-LM checkpoints yet")


def test_generate_tool_decodes_a_trained_hybrid_checkpoint(tmp_path):
    """tools/generate.py on a trained GDN + attention checkpoint: greedy text, and the cache line names
    the per-token K/V of the attention layer and the fixed recurrent state of the linear one."""
    from test_generate import _run_tool, generate_tool
    from training_utils import train_in_process
    path = str(tmp_path / "ckpt")
    run_distributed(train_in_process, 1, GDN + ["--train-iters", "2", "--save", path])
    code, out, err = _run_tool(generate_tool, 0, 1, ["--load", path, "--prompt", "def ", "--greedy",
                                                     "--max-new-tokens", "4"])
    assert code == 0 and out.startswith("def ")
    conv, state = (3 - 1) * (2 * 2 * 8 + 4 * 12), 4 * 8 * 12  # kernel 3; q, k: 2 heads x 8; v: 4 heads x 12
    assert err == (f"> KV cache: {2 * 2 * 16 * 4} bytes per token per sequence on each TP rank, plus "
                   f"{4 * (conv + state)} bytes of recurrent state per sequence\n"), err
