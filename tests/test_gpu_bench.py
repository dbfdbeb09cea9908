"""benchmarks/gpu_bench.py on the CPU at tiny sizes: the rows a GPU call will run, here first.

One run of the script (a subset of its rows: the whole tiny run, compile and CP included, takes a
few minutes on two cores) feeds the checks; the 1.3B arithmetic is checked without running it."""
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_bench.py")
SMOKE_RUN = ["fp32", "fp16", "recompute-full", "checkpoint", "moe"]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gb, peers = _load("gpu_bench"), _load("gpu_bench_peers")


def hand_count(s: dict) -> int:
    """Llama with untied embeddings, no biases, MHA: what all three frameworks must hold."""
    h, f, L, V = s["hidden"], s["ffn"], s["layers"], s["vocab"]
    return L * (4 * h * h + 3 * h * f + 2 * h) + h + 2 * V * h


def hand_flops_per_token(s: dict) -> float:
    n = hand_count(s) - s["vocab"] * s["hidden"]  # without the input embedding
    return 6.0 * n + 12 * s["layers"] * s["hidden"] * s["seq"]  # H * Q = hidden


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gpu_bench") / "gb")
    skip = ",".join(set(gb.smoke_rows()) - set(SMOKE_RUN))
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--out", out, "--skip", skip, "--no-compile", "--mbs", "1,2",
           "--warmup", "1", "--iters", "3", "--jobs", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out + ".json") as f:
        res = json.load(f)
    res["_md"] = open(out + ".md").read()
    res["_stdout"] = proc.stdout
    return res


def rows(res, section):
    return {r["name"]: r for r in res["rows"] if r["section"] == section}


@pytest.mark.slow  # the smoke run of the GPU script (~30 s here); run with -m slow before a GPU call
def test_every_smoke_row_passes_with_finite_losses(result):
    smoke = rows(result, "smoke")
    assert sorted(smoke) == sorted(SMOKE_RUN)
    for name, r in smoke.items():
        assert r["status"] == "PASS", (name, r.get("reason"))
        want = gb.CKPT_ITERS if name == "checkpoint" else gb.SMOKE_ITERS
        assert len(r["losses"]) == want and all(math.isfinite(x) for x in r["losses"]), (name, r["losses"])
    assert "loss scaler" in smoke["fp16"]["reason"] or smoke["fp16"]["reason"] == ""


@pytest.mark.slow  # the smoke run of the GPU script (~30 s here); run with -m slow before a GPU call
def test_checkpoint_round_trip_reproduces_the_uninterrupted_losses(result):
    r = rows(result, "smoke")["checkpoint"]
    assert r["resumed_iterations"] == list(range(gb.CKPT_SAVE_AT + 1, gb.CKPT_ITERS + 1))
    assert r["losses_first_half"] == r["losses"][:gb.CKPT_SAVE_AT]
    assert r["losses_resumed"] == r["losses"][gb.CKPT_SAVE_AT:]  # bitwise on the CPU
    assert r["max_rel_diff"] == 0.0


@pytest.mark.slow  # the smoke run of the GPU script (~30 s here); run with -m slow before a GPU call
def test_mfu_arithmetic_matches_flops_py(result):
    from megatron_lite.training.flops import flops_per_token

    s, m = gb.SHAPES["tiny"], result["mfu"]
    cfg = gb.resolve_ours(gb.ours_argv(s, 1, 4, "cpu", ["--bf16"]))
    fpt = flops_per_token(cfg.model, cfg.training.seq_length)
    assert m["flops_per_token"] == fpt == hand_flops_per_token(s)
    mfu = rows(result, "mfu")
    assert sorted(mfu) == ["ours-eager-mb1", "ours-eager-mb2"]
    for r in mfu.values():
        assert r["status"] == "PASS", r.get("reason")
        timed = r["records"][1:]  # --warmup 1
        assert len(timed) == r["timed_steps"] == 3
        med = statistics.median(x["step_time_s"] for x in timed)
        tps = r["micro_batch"] * s["seq"] / med
        assert r["tokens_per_sec"] == pytest.approx(tps, rel=1e-12)
        assert r["tflops_per_gpu"] == pytest.approx(fpt * tps / 1e12, rel=1e-12)
        assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / 989.0, rel=1e-12)
        for x in timed:  # the trainer's own per-step figure, same convention
            assert x["tflops_per_gpu"] == pytest.approx(fpt * x["tokens_per_sec"] / 1e12, rel=1e-9)
    assert m["best_micro_batch"] == max(mfu.values(), key=lambda r: r["tokens_per_sec"])["micro_batch"]
    assert "6N + 12*L*H*Q*T" in result["_md"] and "not halved" in result["_md"]


@pytest.mark.slow  # the smoke run of the GPU script (~30 s here); run with -m slow before a GPU call
def test_peers_hold_exactly_our_parameters(result):
    s, m = gb.SHAPES["tiny"], result["mfu"]
    assert m["ours_param_count"] == hand_count(s)
    peers = rows(result, "peers")
    mb = m["best_micro_batch"]
    assert sorted(peers) == [f"hf-eager-mb{mb}", f"plain-eager-mb{mb}"]
    for name, r in peers.items():
        assert r["status"] == "PASS", (name, r.get("reason"))
        assert r["param_count"] == m["ours_param_count"], name
        assert all(math.isfinite(x) for x in r["losses"]) and r["tokens_per_sec"] > 0
    assert "ours eager / plain PyTorch eager" in result["_md"]
    assert "CPU smoke run" in result["_md"]


def test_the_1p3b_config_is_the_same_model_in_all_three():
    """The GPU rows' model, counted on the meta device: ours, the plain peer, Hugging Face."""
    s = gb.SHAPES["llama-1.3b"]
    argv = gb.ours_argv(s, 1, 4, "cpu", ["--bf16"])
    n = gb.ours_parameter_count(argv)
    assert n == hand_count(s) and 1.3e9 < n < 1.4e9
    assert gb.ours_flops_per_token(argv) == hand_flops_per_token(s)
    with torch.device("meta"):
        assert sum(p.numel() for p in peers.build_plain(s).parameters()) == n
        pytest.importorskip("transformers")
        assert sum(p.numel() for p in peers.build_hf(s).parameters()) == n


def test_a_failing_row_reports_and_the_rest_goes_on(tmp_path):
    """A row that cannot run (an unknown flag here) says FAIL with the trainer's reason."""
    b = gb.Bench(gb.parse_args(["--device", "cpu", "--only", "smoke", "--out", str(tmp_path / "x")]))
    r = gb.smoke_one(b, "bogus", ["--no-such-flag"])
    assert r["status"] == "FAIL" and "unrecognized arguments: --no-such-flag" in r["reason"]
    assert json.load(open(tmp_path / "x.json"))["rows"][0]["name"] == "bogus"
