"""The cluster examples cannot rot: examples/slurm/pretrain_llama3_8b.sh is run by bash with stand-ins
for `srun` and `scontrol` (which record what they are given), and the pretrain_gpt.py command line
it hands to torchrun is resolved by our own parser and validation at its real size (Llama-3-8B,
16 ranks, a tokenizer of Llama 3's 128256 ids), its derived numbers checked, and planned to fit
on 80 GB H100s. The Dockerfile copies only what exists and keeps its build argument."""
import os
import re
import shlex
import subprocess

import numpy as np
import pytest

from megatron_lite.data.indexed_dataset import IndexedDatasetWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "slurm", "pretrain_llama3_8b.sh")
# The stand-ins: srun writes its argv (NUL-separated) and the environment it was started with.
FAKE_SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$FAKE_OUT/argv"
env > "$FAKE_OUT/env"
"""
FAKE_SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && printf 'gpu-node-001\\ngpu-node-002\\n'
"""


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """What a 2-node allocation would give the script: a corpus, a Llama-3-sized tokenizer, a
    checkpoint directory, SLURM's variables; and the stand-in binaries on PATH."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("cluster")
    vocab = {f"t{i}": i for i in range(128000)}  # Llama 3: 128000 BPE ids + 256 special ones
    vocab.update({f"<|reserved_special_token_{i}|>": 128000 + i for i in range(256)})
    vocab["<|end_of_text|>"] = vocab.pop("<|reserved_special_token_1|>")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end_of_text|>").save_pretrained(str(d / "tokenizer"))
    rng = np.random.default_rng(0)
    for name in ("web", "code"):
        w = IndexedDatasetWriter(str(d / f"{name}_text_document"), np.int32)
        for _ in range(20):
            w.add_document(np.append(rng.integers(0, 128000, 300), 128001))
        w.finalize()
    bin_dir = d / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "CONTAINER_"))}
    env.pop("OMP_NUM_THREADS", None)
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_NNODES="2", SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="gpu-node-[001-002]", TOKENIZER=str(d / "tokenizer"), CKPT_DIR=str(d / "ckpt"),
               DATA_PATH=f"0.7 {d / 'web_text_document'} 0.3 {d / 'code_text_document'}")
    return d, env


def _submit(cluster, **extra):
    """Run the script as sbatch would (from the repository root); the srun argv and environment."""
    d, env = cluster
    out = d / f"run{len(list(d.glob('run*')))}"
    out.mkdir()
    subprocess.run(["bash", SCRIPT], cwd=ROOT, env={**env, **extra, "FAKE_OUT": str(out)}, check=True)
    argv = (out / "argv").read_text().split("\0")[:-1]
    seen = dict(line.split("=", 1) for line in (out / "env").read_text().splitlines() if "=" in line)
    return argv, seen


def _torchrun(argv):
    """(srun options, torchrun options as a dict, pretrain_gpt.py's argv)."""
    t = argv.index("torchrun")
    p = argv.index("pretrain_gpt.py")
    opts = argv[t + 1:p]
    return argv[:t], dict(zip(opts[::2], opts[1::2])), argv[p + 1:]


def test_launch_line_and_environment(cluster):
    argv, env = _submit(cluster)
    srun, torchrun, _ = _torchrun(argv)
    assert srun == []
    assert torchrun == {"--nnodes": "2", "--nproc_per_node": "8", "--rdzv-id": "4242", "--rdzv-backend": "c10d",
                        "--rdzv-endpoint": "gpu-node-001:29500"}
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["NCCL_DEBUG"] == "WARN" and env["NCCL_SOCKET_IFNAME"] and env["OMP_NUM_THREADS"] == "8"
    assert "NCCL_IB_HCA" not in env
    _, env = _submit(cluster, NCCL_IB_HCA="mlx5_0,mlx5_1", NCCL_DEBUG="INFO", NCCL_SOCKET_IFNAME="ib0")
    assert (env["NCCL_IB_HCA"], env["NCCL_DEBUG"], env["NCCL_SOCKET_IFNAME"]) == ("mlx5_0,mlx5_1", "INFO", "ib0")


def test_container_variant(cluster):
    argv, _ = _submit(cluster, CONTAINER_IMAGE="/images/megatron-lite.sqsh", CONTAINER_MOUNTS="/data:/data")
    srun, torchrun, args = _torchrun(argv)
    assert srun == ["--container-image=/images/megatron-lite.sqsh", "--container-workdir=/workspace/megatron-lite",
                    "--container-mounts=/data:/data"]
    assert torchrun["--nnodes"] == "2" and args == _torchrun(_submit(cluster)[0])[2]


def test_arguments_resolve_at_full_size(cluster, monkeypatch):
    """16 ranks: TP 2 x DP 8, ZeRO-1, 16 micro-batches per step; Llama-3-8B's shape and 8.03B
    parameters; the blend, the schedule and the checkpoint settings as the script says."""
    from pretrain_gpt import resolve

    d, _ = cluster
    _, torchrun, args = _torchrun(_submit(cluster)[0])
    world = int(torchrun["--nnodes"]) * int(torchrun["--nproc_per_node"])
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    cfg, tokenizer = resolve(args)
    m, p, t, data = cfg.model, cfg.parallel, cfg.training, cfg.data
    assert world == 16 and tokenizer.vocab_size == 128256 and tokenizer.eod == 128001
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size) == \
        (32, 4096, 32, 8, 14336)
    assert m.rotary_base == 500000.0 and m.family == "llama" and m.padded_vocab_size(2) == 128256
    assert round(m.num_parameters() / 1e9, 2) == 8.03
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size(world)) == (2, 1, 8)
    assert p.sequence_parallel and p.zero_stage == 1 and p.overlap_grad_reduce and p.overlap_param_gather
    assert t.bf16 and t.seq_length == 8192 and t.global_batch_size == 128
    assert t.global_batch_size // (t.micro_batch_size * p.data_parallel_size(world)) == 16
    assert t.train_iters == 10000 and t.save == t.load == str(d / "ckpt") and t.save_interval == 500
    s = t.param_scheduler()
    assert s.lr(0) == 0.0 and s.lr(1000 * 128) == pytest.approx(3e-4) and s.lr(10000 * 128) == pytest.approx(3e-5)
    assert [w for w, _ in _blend(data.data_path)] == [0.7, 0.3]


def _blend(data_path):
    from megatron_lite.data.builder import parse_data_path
    return parse_data_path(data_path)


def test_layout_fits_an_80gb_h100(cluster):
    """The planner (the trainer's own memory accounting) on the script's command line."""
    from tools import plan

    _, torchrun, args = _torchrun(_submit(cluster)[0])
    assert plan.main(args + ["--world-size", "16", "--gpu", "H100", "--gpu-memory", "80GB"]) == 0


def test_dockerfile_copies_what_exists_and_takes_the_base_image_as_an_argument():
    text = open(os.path.join(ROOT, "Dockerfile")).read()
    arg = re.search(r"^ARG BASE_IMAGE=(nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3)$", text, re.M)
    assert arg and re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        *sources, _ = shlex.split(line)
        for src in sources:
            assert os.path.exists(os.path.join(ROOT, src)), src
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in text and "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in text
