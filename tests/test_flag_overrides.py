"""Flags that the configuration drops or overrides are named in a start-up line; explicit run flags
win over --use-checkpoint-args; Megatron-LM's --no-load-optim / --no-load-rng without --load; the
planner's plan as JSON (issue 28)."""
import importlib.util
import json
import os

import pretrain_gpt
from megatron_lite.arguments import parse_args
from models.zoo import zoo
from training_utils import ROOT, TINY

PLAN_FLAGS = ["--model", "llama3-8b", "--bf16", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
              "2", "--use-distributed-optimizer", "--global-batch-size", "64", "--world-size", "16"]
DROPPED = ("--num-query-groups 2 is dropped: Megatron-LM reads it only with --group-query-attention (add it for "
           "grouped-query attention)")


def test_num_query_groups_over_a_preset_wins_and_a_dropped_one_is_named(capsys, monkeypatch):
    cfg = parse_args(["--model", "llama-tiny", "--num-query-groups", "1"], zoo())  # llama-tiny: 2 groups
    assert cfg.model.num_query_groups == 1 and cfg.notes == []
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg, _ = pretrain_gpt.resolve(TINY + ["--num-query-groups", "2"])  # a launch script: Megatron-LM's rule
    assert cfg.model.num_query_groups == cfg.model.num_attention_heads == 4
    assert capsys.readouterr().out.splitlines() == [f"> note: {DROPPED}"]
    cfg, _ = pretrain_gpt.resolve(TINY + ["--num-query-groups", "2", "--group-query-attention"])
    assert cfg.model.num_query_groups == 2 and "> note" not in capsys.readouterr().out


def test_use_checkpoint_args_takes_the_architecture_and_the_run_flags_win(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    ckpt = str(tmp_path / "ckpt")
    assert pretrain_gpt.main(TINY + ["--train-iters", "1", "--save", ckpt]) == 0  # dropout 0, hidden 64
    capsys.readouterr()
    cfg, _ = pretrain_gpt.resolve(["--load", ckpt, "--use-checkpoint-args", "--train-iters", "3", "--device", "cpu",
                                   "--hidden-dropout", "0.2", "--attention-dropout", "0.3", "--hidden-size", "128",
                                   "--micro-batch-size", "2", "--seq-length", "64"])
    assert cfg.model.hidden_size == 64 and cfg.model.num_layers == 2  # the checkpoint's architecture
    assert (cfg.model.hidden_dropout, cfg.model.attention_dropout) == (0.2, 0.3)  # the command line's
    notes = capsys.readouterr().out.splitlines()  # besides, the built-in corpus note (no --data-path given)
    assert [n for n in notes if "without --data-path" not in n] == [
        "> note: --hidden-size 128 is overridden by --use-checkpoint-args: the checkpoint's 64"] and len(notes) == 2


def test_no_load_optim_and_no_load_rng_without_load_are_accepted(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg, _ = pretrain_gpt.resolve(TINY + ["--no-load-optim", "--no-load-rng"])  # Megatron-LM's Mixtral script
    assert cfg.training.no_load_optim and cfg.training.no_load_rng and cfg.training.load is None


def _plan_tool():
    spec = importlib.util.spec_from_file_location("plan_tool", os.path.join(ROOT, "tools", "plan.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_json_holds_what_the_plan_prints(capsys):
    plan = _plan_tool()
    assert plan.main(PLAN_FLAGS) == 0
    text = capsys.readouterr().out
    assert plan.main(PLAN_FLAGS + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    p = out["plan"]
    assert (out["model"], out["world_size"], out["global_batch_size"]) == ("llama3-8b", 16, 64)
    assert f"layout: {p['layout']}\n" in text and p["fits"] and p["settings"]["tp"] == 2
    assert [r["pp_rank"] for r in p["ranks"]] == [0, 1]
    for r in p["ranks"]:
        assert (f"pipeline rank {r['pp_rank']}: params {plan.gib(r['param_bytes'])}, grads {plan.gib(r['grad_bytes'])}"
                in text)
        assert r["device_bytes"] == (r["param_bytes"] + r["grad_bytes"] + r["optimizer_state_bytes"]
                                     + r["activation_bytes"] + sum(r["buffers"].values()))
    assert p["peak_bytes"] == max(r["device_bytes"] for r in p["ranks"])
    assert f"time: {p['time']['total_s']:.2f} s/step" in text and f"MFU {p['time']['mfu']:.1%}" in text


def test_plan_json_search_lists_the_ranked_layouts(capsys):
    plan = _plan_tool()
    flags = ["--model", "llama3-8b", "--world-size", "8", "--search", "--top", "3", "--max-pp", "2"]
    assert plan.main(flags) == 0
    rows = [line.split()[1:3] for line in capsys.readouterr().out.splitlines() if line[:2].strip().isdigit()]
    assert plan.main(flags + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["ranked"]) == 3 and out["fitting"] + out["not_fitting"] + out["refused"] == out["evaluated"]
    assert [r["layout"].split()[:2] for r in out["ranked"]] == rows
    assert all(r["fits"] for r in out["ranked"]) and out["why_best"]
    times = [r["time"]["total_s"] for r in out["ranked"]]
    assert times == sorted(times)
