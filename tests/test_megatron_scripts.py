"""Megatron-LM's own launch scripts, as a user brings them: the flags each example script hands to
pretrain_gpt.py (examples/gpt3/train_gpt3_175b_distributed.sh, examples/llama/
train_llama3_8b_h100_fp8.sh, examples/mixtral/train_mixtral_8x7b_distributed.sh,
examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh with its NSYS branch, and the model
definitions of examples/post_training/modelopt/conf/ for Llama-3.1-8B, Qwen3-8B, Qwen3-30B-A3B).

- At their real sizes every flag parses; what stops one is only a flag that needs a package or a
  device we do not have (NCCL user buffers) or an FP8 part not built yet (delayed scaling's amax
  history, FP8 param gather), with a one-line error, and the numbers Megatron derives from them
  come out the same (iterations from samples, padded vocabulary, schedule).
- Shrunk (sizes, data, device changed, every other flag kept) each trains two iterations on CPU,
  after dropping only those flags (the FP8 scripts train with --fp8-recipe tensorwise).
"""
import shlex

import pytest

from megatron_lite.arguments import FP8_NOT_YET, NEEDS_PACKAGE_FLAGS, parse_args
from megatron_lite.errors import ConfigError
from megatron_lite.testing import run_distributed
from models.zoo import zoo
from training_utils import train_in_process

# The argv each script passes after pretrain_gpt.py (mock-data branches; placeholders in capitals).
SCRIPTS = {
    "gpt3_175b": """--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
        --max-position-embeddings 2048 --attention-backend auto --micro-batch-size 1 --global-batch-size 1536
        --rampup-batch-size 16 16 5859375 --train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
        --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6
        --lr-warmup-fraction .001 --lr-decay-iters 430000 --tensor-model-parallel-size 8
        --pipeline-model-parallel-size 16 --data-path DATA --vocab-file VOCAB --merge-file MERGES --split 949,50,1
        --log-interval 100 --save-interval 10000 --eval-interval 1000 --save CKPT --load CKPT --eval-iters 10
        --tensorboard-dir TB""",
    # today's main: a step-wise schedule (thresholds in tokens) instead of the ramp, by iterations
    "gpt3_175b_main": """--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
        --max-position-embeddings 2048 --attention-backend auto --micro-batch-size 1 --global-batch-size 1536
        --step-batch-size-schedule "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536" --train-iters 500000
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16
        --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
        --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --data-path DATA --vocab-file VOCAB
        --merge-file MERGES --split 949,50,1 --log-interval 100 --save-interval 10000 --eval-interval 1000
        --save CKPT --load CKPT --eval-iters 10 --tensorboard-dir TB""",
    "llama3_8b_fp8": """--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
        --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192
        --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
        --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134
        --attention-backend fused --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
        --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
        --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
        --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
        --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
        --empty-unused-memory-level 1 --exit-duration-in-mins 235 --use-distributed-optimizer --overlap-grad-reduce
        --overlap-param-gather --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
        --fp8-param-gather --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel --mock-data
        --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path CACHE --tiktoken-pattern v2
        --split '99,1,0' --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
        --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
        --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
        --save CKPT --load CKPT --tensorboard-dir TB""",
    "mixtral_8x7b": """--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
        --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01
        --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
        --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8
        --no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000 --num-experts 8 --moe-router-topk 2
        --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm
        --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
        --tokenizer-type Llama2Tokenizer --tokenizer-model SPM --data-path DATA --split 99990,8,2
        --micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000
        --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
        --use-distributed-optimizer --sequence-parallel --log-interval 1 --save-interval 10000 --eval-interval 1000
        --eval-iters 10 --save CKPT --load CKPT --tensorboard-dir TB --no-load-optim --no-load-rng""",
    "llama3_8b_fsdp_nsys": """--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
        --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192
        --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
        --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134
        --attention-backend fused --apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear
        --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
        --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
        --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
        --cross-entropy-loss-fusion --no-check-for-nan-in-loss-and-grad --manual-gc --empty-unused-memory-level 1
        --exit-duration-in-mins 235 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
        --no-gradient-accumulation-fusion --calculate-per-token-loss --init-model-with-meta-device
        --ckpt-format fsdp_dtensor --use-nccl-ub --fsdp-double-buffer --fsdp-manual-registration
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --profile --profile-step-start 8
        --profile-step-end 12 --profile-ranks 0 --record-memory-history --fp8-format hybrid
        --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather --tensor-model-parallel-size 1
        --context-parallel-size 1 --sequence-parallel --mock-data --tokenizer-type NullTokenizer --vocab-size 128256
        --data-cache-path CACHE --tiktoken-pattern v2 --split '99,1,0' --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files --num-workers 1 --log-interval 1 --eval-iters 32 --eval-interval 100
        --save-interval 1000 --log-throughput --logging-level 20 --distributed-timeout-minutes 60 --save CKPT
        --load CKPT --tensorboard-dir TB""",
    # modelopt confs: model definitions; a run adds its length, batch and data
    "conf_llama3.1_8b": """--save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
        --disable-bias-linear --untie-embeddings-and-output-weights --use-rotary-position-embeddings
        --rotary-percent 1.0 --no-rope-fusion --no-position-embedding --normalization RMSNorm --swiglu
        --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention
        --num-query-groups 8 --seq-length 4096 --max-position-embeddings 8192 --tokenizer-type HuggingFaceTokenizer
        --make-vocab-size-divisible-by 1 --use-mcore-models --rotary-base 500000 --use-rope-scaling""",
    "conf_qwen3_8b": """--save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
        --disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion
        --normalization RMSNorm --swiglu --num-layers 36 --hidden-size 4096 --ffn-hidden-size 12288
        --num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128 --qk-layernorm
        --seq-length 4096 --max-position-embeddings 40960 --tokenizer-type HuggingFaceTokenizer
        --make-vocab-size-divisible-by 1187 --use-mcore-models --rotary-percent 1.0 --rotary-base 1000000
        --no-bias-swiglu-fusion""",
    "conf_qwen3_30b_a3b": """--save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
        --disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion
        --normalization RMSNorm --swiglu --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144
        --num-attention-heads 32 --group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm
        --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8 --moe-router-dtype fp32
        --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss
        --moe-layer-recompute --seq-length 4096 --max-position-embeddings 40960 --tokenizer-type HuggingFaceTokenizer
        --make-vocab-size-divisible-by 1187 --use-mcore-models --rotary-percent 1.0 --rotary-base 1000000
        --no-bias-swiglu-fusion --sequence-parallel""",
}
CONF_RUN = "--train-iters 2 --global-batch-size 2 --lr 1e-4 --mock-data --tokenizer-model HF"


def _argv(name):
    argv = shlex.split(SCRIPTS[name]) + (shlex.split(CONF_RUN) if name.startswith("conf_") else [])
    return _by_samples(argv) if name == "gpt3_175b" else argv


def _by_samples(argv):
    """The GPT-3 script's ramp-up with --train-iters is refused, as Megatron-LM refuses it ('expected
    no batch-size rampup for iteration-based training'): its run by samples, iterations x the
    global batch (500000 x 1536), decay likewise."""
    gbs = int(argv[argv.index("--global-batch-size") + 1])
    out = list(argv)
    for flag, to in (("--train-iters", "--train-samples"), ("--lr-decay-iters", "--lr-decay-samples")):
        i = out.index(flag)
        out[i:i + 2] = [to, str(int(out[i + 1]) * gbs)]
    return out


REFUSED_FORMATS = ("torch_dist", "fsdp_dtensor")  # Megatron-LM's checkpoint formats: refused, we write ours


def _without_package_flags(argv):
    """argv less the flags that are refused here: needing a package, an FP8 part not built yet, or a
    Megatron-LM checkpoint format; an FP8 script (Megatron-LM's default recipe, delayed, is one of
    those parts) takes tensorwise scaling."""
    out, skip = [], False
    for i, tok in enumerate(argv):
        if tok == "--ckpt-format" and argv[i + 1] in REFUSED_FORMATS or tok in REFUSED_FORMATS:
            continue
        if tok in NEEDS_PACKAGE_FLAGS or tok in FP8_NOT_YET:
            skip = True
            continue
        if skip and not tok.startswith("--"):
            continue
        skip = False
        out.append(tok)
    return out + (["--fp8-recipe", "tensorwise"] if "--fp8-format" in out and "--fp8-recipe" not in out else [])


def _with(argv, **values):
    """argv with the values of some flags replaced (flag name with _ for -); a list value is
    several words."""
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        key = tok[2:].replace("-", "_")
        if tok.startswith("--") and key in values:
            out.append(tok)
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
            v = values[key]
            out += [str(x) for x in v] if isinstance(v, (list, tuple)) else [str(v)]
        else:
            out.append(tok)
            i += 1
    return out


def _fill(argv, files):
    return [files.get(tok, tok) for tok in argv]


def _mock_data(argv):
    """Data: the mock dataset instead of the script's corpus."""
    if "--data-path" not in argv:
        return argv
    i = argv.index("--data-path")
    return argv[:i] + ["--mock-data"] + argv[i + 2:]


# --- at the real sizes ------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_flag_parses_or_names_the_missing_package(name, script_files):
    argv = _fill(_argv(name), script_files)
    needs = [t for t in argv if t in NEEDS_PACKAGE_FLAGS or t in FP8_NOT_YET]
    formats = [f"--ckpt-format {t}" for t in argv if t in REFUSED_FORMATS]
    if needs or formats:
        with pytest.raises(ConfigError) as e:
            parse_args(argv, zoo())
        message = str(e.value)  # every refused flag of the script, in one line
        assert "\n" not in message and all(f"{n}: " in message or f"{n} (" in message for n in needs + formats), message
        assert not needs or "does not use" in message or "not implemented yet" in message
    parse_args(_without_package_flags(argv), zoo())


def test_llama3_script_derives_megatrons_numbers(script_files, monkeypatch):
    """8 GPUs: 1953125000 // 128 iterations; NullTokenizer 128256 + EOD padded to 128384; the LR
    schedule in samples with the decoupled group; Megatron's schedule values at a few points."""
    import math

    from pretrain_gpt import resolve

    monkeypatch.setenv("WORLD_SIZE", "8")
    argv = _fill(_without_package_flags(_argv("llama3_8b_fp8")), script_files)
    cfg, tokenizer = resolve(argv)
    t, m = cfg.training, cfg.model
    assert t.train_iters == 15_258_789 and cfg.parallel.zero_stage == 1
    assert tokenizer.vocab_size == 128257 and m.padded_vocab_size(1) == 128384
    assert t.calculate_per_token_loss and m.apply_layernorm_1p and m.kv_channels == 128
    s = t.param_scheduler()
    assert s.lr(0) == 0.0 and s.lr(3_906_252) == pytest.approx(1.5e-4)
    assert s.lr(3_906_252 / 2, "decoupled") == pytest.approx(2.5e-4)
    mid = (3_906_252 + 1_949_218_748) / 2  # halfway through the cosine: (max + min) / 2
    assert s.lr(mid) == pytest.approx((1.5e-4 + 1e-5) / 2) and s.lr(mid, "decoupled") == pytest.approx((5e-4 + 4.5e-5) / 2)
    assert s.lr(2e9) == pytest.approx(1e-5) and s.weight_decay(123) == 0.1
    assert math.isclose(s.lr(1_000_000), 1.5e-4 * 1_000_000 / 3_906_252)


def test_fsdp_script_maps_onto_zero3_and_the_gpt3_ramp(script_files, monkeypatch):
    from pretrain_gpt import resolve

    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg, _ = resolve(_fill(_without_package_flags(_argv("llama3_8b_fsdp_nsys")), script_files))
    assert cfg.parallel.zero_stage == 3 and cfg.training.profile_ranks == [0] and cfg.training.logging_level == 20
    monkeypatch.setenv("WORLD_SIZE", "128")
    with pytest.raises(ConfigError, match="expects no batch-size rampup for iteration-based training"):
        resolve(_mock_data(_fill(shlex.split(SCRIPTS["gpt3_175b"]), script_files)))
    cfg, _ = resolve(_mock_data(_fill(_argv("gpt3_175b"), script_files)))
    # the ramp's steps are smaller than the full batch: more of them
    assert cfg.training.train_samples == 500_000 * 1536 and cfg.training.train_iters > 500_000
    b = cfg.training.batch_schedule(1)  # DP = 128 / (8 x 16)
    assert [b.global_batch_size(c) for c in (0, 61677, 61678, 5859375, 5859376)] == [16, 16, 32, 1536, 1536]
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer"  # Megatron's default, from --vocab-file
    assert cfg.model.attention_dropout == 0.1 and cfg.model.hidden_dropout == 0.1  # Megatron's defaults


def test_gpt3_main_script_runs_megatrons_step_schedule(script_files, monkeypatch):
    """Today's GPT-3 script: 16 samples a step until 2.4B tokens (1171875 samples of 2048), ... 1536
    from 12B; its --global-batch-size is the schedule's last batch; another one is refused, as are
    the ramp and --decrease-batch-size-if-needed beside the schedule."""
    from pretrain_gpt import resolve

    monkeypatch.setenv("WORLD_SIZE", "128")
    argv = _mock_data(_fill(_argv("gpt3_175b_main"), script_files))
    cfg, _ = resolve(argv)
    b = cfg.training.batch_schedule(1)
    assert cfg.training.train_iters == 500_000
    assert [b.global_batch_size(c) for c in (0, 1171874, 1171875, 5859374, 5859375)] == [16, 16, 320, 1232, 1536]
    for extra, flag in ((["--global-batch-size", "1024"], "--global-batch-size"),
                        (["--decrease-batch-size-if-needed"], "--decrease-batch-size-if-needed")):
        with pytest.raises(ConfigError, match=f"--step-batch-size-schedule and {flag} are exclusive"):
            resolve(argv + extra)


# --- shrunk, two iterations on CPU ------------------------------------------------------------
SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
             kv_channels=16, seq_length=32, max_position_embeddings=64, micro_batch_size=1, global_batch_size=4,
             train_iters=2, train_samples=8, lr_decay_samples=6, lr_warmup_samples=2, lr_decay_iters=2,
             lr_warmup_iters=1, rampup_batch_size=[2, 2, 2], step_batch_size_schedule="0:2 64:4", eval_iters=1, eval_interval=2, vocab_size=250,
             num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, profile_step_start=0, profile_step_end=1,
             num_workers=0)  # (forked test ranks are daemons: no loader worker processes)
LAYOUTS = {"gpt3_175b": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
           "gpt3_175b_main": (2, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)),
           "llama3_8b_fp8": (2, {}), "llama3_8b_fsdp_nsys": (2, {}),
           "mixtral_8x7b": (4, dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2)),
           "conf_llama3.1_8b": (1, {}), "conf_qwen3_8b": (1, {}), "conf_qwen3_30b_a3b": (2, {})}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_shrunk_script_trains_two_iterations(name, script_files, tmp_path):
    world, layout = LAYOUTS[name]
    files = dict(script_files, CKPT=str(tmp_path / "ckpt"), TB=str(tmp_path / "tb"), CACHE=str(tmp_path / "cache"))
    argv = _with(_mock_data(_fill(_without_package_flags(_argv(name)), files)), **{k: v for k, v in SMALL.items()
                                                                        if f"--{k.replace('_', '-')}" in _argv(name)},
                 **layout)
    histories = run_distributed(train_in_process, world, argv + ["--device", "cpu"])
    records = next(h for h in histories if h and h[0]["lm_loss"] is not None)
    assert len(records) == 2 and all(r["lm_loss"] > 0 for r in records)
    assert records[-1]["consumed_samples"] == sum(r["global_batch_size"] for r in records)
    if "--step-batch-size-schedule" in argv:  # "0:2 64:4": 2 samples from 0, 4 from 64 tokens = 2 samples
        assert [r["global_batch_size"] for r in records] == [2, 4]
    if "--profile" in argv:  # traced step 1 (start 0, end 1) on rank 0, beside --tensorboard-dir
        assert (tmp_path / "torch_profile" / "rank-0.json.gz").stat().st_size > 0


@pytest.fixture(scope="module")
def script_files(tmp_path_factory):
    """Tokenizer files the scripts point at: GPT-2 BPE vocab/merges, a SentencePiece model, a
    Hugging Face tokenizer directory (all tiny, trained here)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from megatron_lite.data import build_tokenizer
    from test_data_tokenizers import corpus
    from tools.train_tokenizer import train

    d = tmp_path_factory.mktemp("script_files")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus()[:200], vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(d))
    vocab, merges = str(d / "vocab.json"), str(d / "merges.txt")
    inner = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)._tok
    PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|endoftext|>").save_pretrained(str(d / "hf"))
    (d / "c.txt").write_text("\n".join(corpus()[:200]))
    spm = train([str(d / "c.txt")], str(d / "spm"), vocab_size=800)
    return {"VOCAB": vocab, "MERGES": merges, "HF": str(d / "hf"), "SPM": spm, "DATA": str(d / "unused_prefix"),
            "CKPT": str(d / "ckpt"), "TB": str(d / "tb"), "CACHE": str(d / "cache")}
