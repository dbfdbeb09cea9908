"""Every impossible configuration is one line on stderr, exit code 2, before any process group."""
import os
import subprocess
import sys

import pytest

import pretrain_gpt

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--train-iters", "5", "--device", "cpu", "--attention-dropout", "0",
        "--hidden-dropout", "0"]

DUALPIPE_MOE = ["--pipeline-model-parallel-size", "2", "--num-experts", "4", "--expert-model-parallel-size", "2",
                "--global-batch-size", "16", "--overlap-moe-expert-parallel-comm", "--moe-token-dispatcher-type",
                "alltoall"]
CASES = [
    # (world size, extra flags, fragments the message must contain)
    (5, ["--num-attention-heads", "12", "--hidden-size", "96", "--tensor-model-parallel-size", "5"],
     ["num_attention_heads (12)", "tensor_model_parallel_size (5)"]),
    (2, ["--num-attention-heads", "6", "--hidden-size", "96", "--group-query-attention", "--num-query-groups", "3",
         "--tensor-model-parallel-size", "2"], ["num_query_groups (3)", "tensor_model_parallel_size (2)"]),
    (2, ["--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "3"],
     ["num_attention_heads (4)", "num_query_groups (3)"]),
    (3, ["--tensor-model-parallel-size", "2"], ["world size (3)", "tensor_model_parallel_size (2)"]),
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"], ["world size (4)", "= 8"]),
    (2, ["--global-batch-size", "6"], ["global_batch_size (6)", "micro_batch_size (2)", "data-parallel size (2)"]),
    (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "63"],
     ["seq_length (63)", "tensor_model_parallel_size (2)", "--sequence-parallel"]),
    (1, ["--model", "gpt5-mega"], ["unknown --model 'gpt5-mega'", "llama3-8b"]),
    (1, ["--bf16", "--fp16"], ["--bf16 and --fp16"]),
    (1, ["--seq-length", "2048", "--max-position-embeddings", "1024"],
     ["seq_length (2048)", "max_position_embeddings (1024)"]),
    (2, ["--ffn-hidden-size", "99", "--tensor-model-parallel-size", "2"], ["ffn_hidden_size (99)"]),
    (1, ["--transformer-impl", "transformer_engine"], ["--transformer-impl transformer_engine"]),
    (1, ["--context-parallel-size", "2"], ["context_parallel_size (2)"]),
    # pipeline parallelism
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "3"],
     ["num_layers (3)", "pipeline_model_parallel_size (2)"]),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--virtual-pipeline-model-parallel-size", "4",
         "--global-batch-size", "4"], ["num_layers (4)", "= 8"]),
    (4, ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--pipeline-schedule", "zb-h1",
         "--micro-batch-size", "1", "--global-batch-size", "2"], ["micro-batches (2)", "pipeline stages (4)"]),
    (4, ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1",
         "--micro-batch-size", "1", "--global-batch-size", "6"], ["micro-batches (6)", "multiple"]),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "3"],
     ["--num-layers-per-virtual-pipeline-stage (3)"]),
    (4, ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--decoder-first-pipeline-num-layers", "3",
         "--global-batch-size", "4", "--micro-batch-size", "1"], ["num_layers (8)", "first (3)"]),
    (1, ["--virtual-pipeline-model-parallel-size", "2"], ["virtual pipeline stages (2)"]),
    (1, ["--pipeline-schedule", "zb-v"], ["'zb-v' needs pipeline_model_parallel_size >= 2 (got 1)"]),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "8", "--pipeline-schedule", "zb-v",
         "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4"],
     ["two model chunks per rank (got virtual pipeline size 4)"]),
    (4, ["--pipeline-model-parallel-size", "4", "--num-layers", "8", "--pipeline-schedule", "zb-v",
         "--micro-batch-size", "1", "--global-batch-size", "3"], ["at least 4 micro-batches", "(got 3)"]),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "8", "--pipeline-schedule", "zb-v",
         "--decoder-first-pipeline-num-layers", "3", "--global-batch-size", "4"], ["first (3)", "remaining pipeline stages"]),
    # values that must not be silently replaced or crash deep inside
    (1, ["--num-attention-heads", "5"], ["hidden_size (64)", "num_attention_heads (5)", "--kv-channels"]),
    (1, ["--ffn-hidden-size", "0"], ["ffn_hidden_size (0)"]),
    (1, ["--make-vocab-size-divisible-by", "0"], ["make_vocab_size_divisible_by (0)"]),
    (1, ["--seed", "-1"], ["seed (-1)"]),
    (1, ["--num-workers", "-1"], ["num_workers (-1)"]),
    (1, ["--seq-length", "0"], ["seq_length (0)"]),
    (1, ["--group-query-attention", "--num-query-groups", "0"], ["num_query_groups (0)"]),
    (1, ["--global-batch-size", "-4"], ["global_batch_size (-4)"]),
    (1, ["--eval-iters", "-1"], ["eval_iters (-1)"]),
    (1, ["--split", "0,100,0"], ["--split 0,100,0", "no training data"]),
    (1, ["--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"], ["exclusive"]),
    (1, ["--rampup-batch-size", "16", "16", "1000"], ["--rampup-batch-size with --train-iters", "--train-samples"]),
    # issue 26: parallel sizes of 0 (no ZeroDivisionError), sizes or schedules that would be ignored
    (1, ["--tensor-model-parallel-size", "0"], ["tensor_model_parallel_size (0) must be >= 1"]),
    (1, ["--pipeline-model-parallel-size", "0"], ["pipeline_model_parallel_size (0) must be >= 1"]),
    (1, ["--context-parallel-size", "0"], ["context_parallel_size (0) must be >= 1"]),
    (2, ["--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "1", "2"],
     ["--hierarchical-context-parallel-sizes applies to --cp-comm-type a2a+p2p"]),
    (1, ["--pipeline-schedule", "interleaved"], ["'interleaved' needs virtual pipeline size > 1 (got 1)"]),
    (1, ["--fp8-recipe", "rowwise"], ["--fp8-recipe rowwise needs --fp8-format e4m3|hybrid"]),
    (1, ["--fp8-margin", "2"], ["--fp8-margin 2 needs --fp8-format e4m3|hybrid"]),
    (1, ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-margin", "-1"], ["--fp8-margin (-1) must be >= 0"]),
    (1, ["--fp8-amax-history-len", "16"], ["--fp8-amax-history-len 16 needs --fp8-format e4m3|hybrid"]),
    (1, ["--first-last-layers-bf16"], ["--first-last-layers-bf16 needs --fp8-format e4m3|hybrid"]),
    (1, ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--fp8-amax-history-len", "16"],
     ["--fp8-amax-history-len is delayed scaling's and does nothing with --fp8-recipe rowwise: drop it"]),
    (1, ["--fp8-format", "e4m3", "--fp8-amax-history-len", "0"], ["--fp8-amax-history-len (0) must be >= 1"]),
    (1, ["--fp8-format", "e4m3", "--num-layers-at-end-in-bf16", "2"],
     ["--num-layers-at-end-in-bf16 needs --first-last-layers-bf16"]),
    (1, ["--fp8-format", "e4m3", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "3"],
     ["--num-layers-at-start-in-bf16 (3) must be between 0 and the layers per pipeline stage (2)"]),
    (2, ["--num-distributed-optimizer-instances", "2"], ["--num-distributed-optimizer-instances (2)",
                                                          "distributed optimizer"]),
    (4, ["--num-distributed-optimizer-instances", "3", "--use-distributed-optimizer"],
     ["--num-distributed-optimizer-instances (3)", "must divide", "(4)"]),
    (1, ["--use-precision-aware-optimizer"], ["--use-precision-aware-optimizer", "distributed optimizer"]),
    (1, ["--profile", "--profile-step-start", "3", "--profile-step-end", "3"], ["--profile-step-start (3)"]),
    (1, ["--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
    (1, ["--lr-decay-style", "exponential"], ["--lr-decay-style", "exponential"]),
    (1, ["--tokenizer-type", "FancyTokenizer"], ["FancyTokenizer"]),
    (2, ["--context-parallel-size", "2", "--seq-length", "66"], ["seq_length (66)", "2 x context_parallel_size (2)"]),
    (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "2", "--hidden-size", "64"],
     ["--cp-comm-type a2a", "2 attention heads", "p2p"]),
    (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2",
         "3"], ["a2a+p2p", "A x B = context_parallel_size (4)"]),
    (3, ["--context-parallel-size", "2"], ["world size (3)", "context_parallel_size (2)"]),
    (2, ["--context-parallel-size", "2", "--cp-comm-type", "ring"], ["--cp-comm-type 'ring'"]),
    (2, ["--context-parallel-size", "2", "--attention-dropout", "0.1"], ["--attention-dropout 0.1"]),
    (4, ["--num-experts", "4", "--expert-model-parallel-size", "3"], ["expert_model_parallel_size (3)"]),
    (2, ["--num-experts", "3", "--expert-model-parallel-size", "2"], ["num_experts (3)", "expert model parallel"]),
    (2, ["--expert-model-parallel-size", "2"], ["need an MoE model", "--num-experts"]),
    (1, ["--moe-router-topk", "2"], ["--moe-router-topk is an MoE setting", "--num-experts"]),
    (1, ["--num-experts", "4", "--moe-router-topk", "5"], ["moe_router_topk (5)"]),
    (4, ["--num-experts", "4", "--tensor-model-parallel-size", "4", "--expert-tensor-parallel-size", "8"],
     ["expert grid does not fit", "expert_tensor_parallel_size (8)", "ETP x EP x EDP = TP x CP x DP"]),
    (1, ["--num-experts", "4", "--moe-layer-freq", "[1,0,1]"], ["moe_layer_freq", "2 layers"]),
    (1, ["--qk-layernorm-full-width"], ["--qk-layernorm-full-width", "add --qk-layernorm"]),
    (1, ["--adam-beta2", "1.5"], ["--adam-beta2 (1.5)", "[0, 1)"]),
    (1, ["--adam-eps", "0"], ["--adam-eps (0.0)"]),
    (1, ["--clip-grad", "-1"], ["--clip-grad (-1.0)", "0 disables"]),
    (1, ["--weight-decay", "-0.1"], ["--weight-decay (-0.1)"]),
    (1, ["--num-layers", "1", "--recompute-granularity", "full", "--recompute-num-layers", "5"],
     ["--recompute-num-layers (5)", "1 layers"]),
    (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
         "--recompute-num-layers", "3"], ["--recompute-num-layers (3)", "use at most 2"]),
    (1, ["--recompute-modules", "mlp"], ["--recompute-modules needs --recompute-granularity selective"]),
    (1, ["--recompute-granularity", "selective", "--recompute-modules", "moe_act"],
     ["--recompute-modules moe_act needs MoE layers"]),
    (1, ["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"],
     ["--recompute-modules mla_up_proj needs --multi-latent-attention"]),
    (1, ["--num-experts", "2", "--recompute-granularity", "selective", "--recompute-modules", "shared_experts"],
     ["--recompute-modules shared_experts needs a shared expert"]),
    (1, ["--cpu-offloading", "--cpu-offloading-num-layers", "2"], ["--cpu-offloading-num-layers (2)", "[0, 1]"]),
    (1, ["--cpu-offloading-num-layers", "1"], ["--cpu-offloading-num-layers", "need --cpu-offloading"]),
    (1, ["--cpu-offloading", "--cpu-offloading-num-layers", "1", "--cpu-offloading-weights"],
     ["--cpu-offloading-weights is not implemented"]),
    (1, ["--cpu-offloading", "--cpu-offloading-num-layers", "1", "--recompute-granularity", "selective"],
     ["--cpu-offloading with --recompute-granularity", "use one of them"]),
    (1, ["--hang-detection-factor", "1"], ["--hang-detection-factor (1.0) must be > 1"]),
    (1, ["--hang-detection-factor", "5", "--hang-detection-warmup-steps", "0"],
     ["--hang-detection-warmup-steps (0) must be >= 1"]),
    (1, ["--log-straggler", "--straggler-minmax-count", "0"], ["--straggler-minmax-count (0) must be >= 1"]),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "6", "--pipeline-schedule", "zb-v",
         "--pipeline-model-parallel-layout", "Et|t|t|t|t|tL", "--global-batch-size", "8"],
     ["'Et|t|t|t|t|tL' has 6 stages", "give 2 x 2 = 4 stages"]),
    # DualPipe-V's overlapped pairs (--overlap-moe-expert-parallel-comm)
    (4, DUALPIPE_MOE + ["--pipeline-schedule", "zb-v"], ["--overlap-moe-expert-parallel-comm", "dualpipe-v"]),
    (2, DUALPIPE_MOE[:2] + ["--pipeline-schedule", "dualpipe-v", "--overlap-moe-expert-parallel-comm",
                            "--global-batch-size", "8"], ["--num-experts", "--expert-model-parallel-size > 1 (got 1)"]),
    (4, DUALPIPE_MOE + ["--pipeline-schedule", "dualpipe-v", "--moe-token-dispatcher-type", "allgather"],
     ["--moe-token-dispatcher-type allgather", "add --moe-token-dispatcher-type alltoall"]),
    (4, DUALPIPE_MOE + ["--pipeline-schedule", "dualpipe-v", "--zero-stage", "3"], ["--no-reshard-after-forward"]),
    (2, ["--grad-comm-dtype", "fp8-e4m3", "--grad-reduce-in-bf16"],
     ["--grad-comm-dtype fp8-e4m3 compresses fp32 gradient buffers", "--grad-reduce-in-bf16"]),
    (2, ["--grad-comm-dtype", "bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
         "--main-grads-dtype", "bf16"], ["--grad-comm-dtype bf16", "--main-grads-dtype bf16"]),
    (1, ["--grad-comm-dtype", "int4"], ["--grad-comm-dtype", "invalid choice: 'int4'"]),
    (2, ["--optimizer", "adam-1bit", "--use-distributed-optimizer"], ["--optimizer adam-1bit", "--zero-stage 0"]),
    (1, ["--optimizer", "adam-1bit", "--freeze-step", "0"], ["--freeze-step (0) must be >= 1"]),
    (1, ["--optimizer", "adam-1bit", "--fp16"], ["--optimizer adam-1bit", "drop --fp16"]),
    (2, ["--optimizer", "adam-1bit", "--grad-comm-dtype", "bf16"], ["drop --grad-comm-dtype bf16"]),
    (2, ["--optimizer", "adam-01", "--zero-stage", "1"], ["--optimizer adam-01", "--zero-stage 0"]),
    (1, ["--optimizer", "adam-01", "--var-freeze-step", "-1"], ["--var-freeze-step (-1) must be >= 1"]),
    (1, ["--optimizer", "adam-01", "--var-update-scaler", "0"], ["--var-update-scaler (0) must be >= 1"]),
    (1, ["--optimizer", "adam-01", "--local-step-scaler", "0"], ["--local-step-scaler (0) must be >= 1"]),
    (1, ["--optimizer", "adam-01", "--local-step-clipper", "0"], ["--local-step-clipper (0) must be >= 1"]),
    (1, ["--optimizer", "adam-01", "--fp16"], ["--optimizer adam-01", "drop --fp16"]),
    (2, ["--optimizer", "adam-01", "--grad-comm-dtype", "fp8-e4m3"], ["drop --grad-comm-dtype fp8-e4m3"]),
    (1, ["--var-freeze-step", "10"], ["--var-freeze-step needs --optimizer adam-01"]),
    (1, ["--freeze-step", "10"], ["--freeze-step needs --optimizer adam-1bit (0/1 Adam's is --var-freeze-step)"]),
    (1, ["--optimizer", "adam-01", "--optimizer-offload-nvme-path", "/tmp"],
     ["--optimizer adam-01 with --optimizer-offload-nvme-path is not implemented"]),
    (2, ["--zeropp-quantized-weights", "--zero-stage", "2"], ["--zeropp-quantized-weights", "--zero-stage 3"]),
    (4, ["--zeropp-hpz-partition-size", "3", "--zero-stage", "3"], ["--zeropp-hpz-partition-size (3)", "(4)"]),
    (4, ["--zeropp-hpz-partition-size", "0", "--zero-stage", "3"], ["--zeropp-hpz-partition-size (0) must be >= 1"]),
    (1, ["--optimizer-offload-nvme-path", ""], ["--optimizer-offload-nvme-path is empty"]),
    (4, ["--zeropp-hpz-partition-size", "2", "--zero-stage", "1"], ["--zeropp-hpz-partition-size", "--zero-stage 3"]),
    (2, ["--zeropp-quantized-gradients", "--zero-stage", "2"], ["--zeropp-quantized-gradients", "--zero-stage 3"]),
    (2, ["--zeropp-quantized-gradients", "--zero-stage", "3", "--grad-comm-dtype", "bf16"],
     ["--zeropp-quantized-gradients", "drop --grad-comm-dtype"]),
    (2, ["--zeropp-qgz-error-feedback", "--zero-stage", "3"], ["--zeropp-qgz-error-feedback", "add --zeropp-quantized-gradients"]),
]


@pytest.mark.parametrize("world,flags,fragments", CASES)
def test_bad_configuration_is_one_clear_line(world, flags, fragments, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert pretrain_gpt.main(BASE + flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for frag in fragments:
        assert frag in err, f"{frag!r} not in {err!r}"


def test_missing_data_path_fails_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    missing = str(tmp_path / "nothing_text_document")
    assert pretrain_gpt.main(BASE + ["--data-path", "0.5", missing, "0.5", missing]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "nothing_text_document" in err and "\n" not in err, err
    assert pretrain_gpt.main(BASE + ["--data-path", "0.5", missing, "0.5"]) == 2
    assert "pairs" in capsys.readouterr().err


def test_cli_exit_code_and_no_traceback():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, WORLD_SIZE="2", RANK="0")
    proc = subprocess.run([sys.executable, os.path.join(root, "pretrain_gpt.py"), *BASE,
                           "--num-attention-heads", "3", "--tensor-model-parallel-size", "2"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "num_attention_heads (3)" in proc.stderr


def _last_error_line(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_non_finite_loss_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    ckpt = tmp_path / "ckpt"
    flags = BASE + ["--lr", "1e30", "--lr-warmup-iters", "0", "--train-iters", "6", "--clip-grad", "0",
                    "--save", str(ckpt), "--save-interval", "1"]
    assert pretrain_gpt.main(flags) == 2
    err = _last_error_line(capsys)
    assert err.startswith("error: iteration ") and "not finite" in err and "is kept" in err, err
    stopped = int(err.split()[2].rstrip(":"))
    from megatron_lite.checkpoint import read_tracker
    assert read_tracker(str(ckpt)) == stopped - 1  # nothing saved from the bad iteration on
    # and with the check off, the same run goes on to the end
    assert pretrain_gpt.main(flags[:-4] + ["--no-check-for-nan-in-loss-and-grad"]) == 0


def test_fp16_weights_that_overflow_stop_the_run(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert pretrain_gpt.main(BASE + ["--fp16", "--lr", "1e6", "--lr-warmup-iters", "0", "--train-iters", "3",
                                     "--loss-scale", "1"]) == 2
    err = _last_error_line(capsys)
    assert "iteration 1: fp16 parameters overflow" in err and "--bf16" in err, err


def test_switches_that_turn_off_say_so_in_their_help():
    """--no-verify-checkpoint skips the checksums: its help must not read as if it checked them."""
    from megatron_lite.arguments import build_parser
    from models.zoo import zoo

    actions = {a.option_strings[0]: a for a in build_parser(zoo())._actions if a.option_strings}
    assert actions["--no-verify-checkpoint"].help == ("turn off (on by default): check the checkpoint's checksums "
                                                      "on load")
    assert actions["--no-check-for-nan-in-loss-and-grad"].help.startswith("turn off (on by default): stop on")
