"""Flexible pipeline layouts: Megatron-LM's --pipeline-model-parallel-layout (checked against
Megatron-Core's own parser), uneven first/last stages with virtual stages, the embedding / loss
counted in the split; one-line errors for impossible ones; and training parity with the single
process for each kind, on every schedule."""
import pytest

import pretrain_gpt
from megatron_lite.parallel.pipeline.partition import LayerSplit, parse_layout, stage_sizes
from megatron_lite.testing import assert_same_run, run_distributed
from training_utils import merged_params, records_of, train_and_gather

BASE = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", "3", "--device", "cpu", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--lr", "3e-3", "--eval-iters", "0", "--disable-bias-linear"]

LAYOUTS = [  # (layout, pp, num_layers)
    ("Et*3|(tt|)*29,t|L", 8, 62),  # the DeepSeek-style split without the MTP entry: pp8 x vpp4
    ("E|tt|tt|L", 2, 4),
    ("Et|tttL", 2, 4),
    ("Ettt|t*3|(t|)*3,tL", 2, 10),
    ("E,t*2|t|t|tL", 4, 5),
]


@pytest.mark.parametrize("layout,pp,layers", LAYOUTS)
def test_layout_strings_parse_as_megatron_core_does(layout, pp, layers):
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    theirs = PipelineParallelLayerLayout(layout, pp)
    theirs.validate_layer_layout(layers, None)
    vpp = theirs.virtual_pipeline_model_parallel_size
    expected = [theirs.layout[r][c].count(LayerType.decoder) for c in range(vpp) for r in range(pp)]
    assert len(parse_layout(layout)) == pp * vpp
    assert stage_sizes(layers, pp, vpp, LayerSplit(layout=layout)) == expected


def test_mtp_layouts_against_megatron_core():
    """MTP with the loss (its stage may hold no decoder layer) parses as Megatron-Core parses it; its
    standalone MTP (the m stage before the loss's), which it accepts, is refused here by name."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from megatron_lite.errors import ConfigError
    from megatron_lite.parallel.pipeline.partition import layout_mtp_layers

    theirs = PipelineParallelLayerLayout("Ett|tt|mmL", 3)
    assert theirs.validate_layer_layout(4, 2) is False  # not standalone
    assert stage_sizes(4, 3, 1, LayerSplit(layout="Ett|tt|mmL")) == [theirs.layout[r][0].count(LayerType.decoder)
                                                                     for r in range(3)] == [2, 2, 0]
    assert layout_mtp_layers("Ett|tt|mmL") == sum(theirs.layout[r][0].count(LayerType.mtp) for r in range(3)) == 2
    assert PipelineParallelLayerLayout("Ett|tmm|L", 3).validate_layer_layout(3, 2) is True  # standalone
    with pytest.raises(ConfigError, match="standalone MTP, is not supported"):
        stage_sizes(3, 3, 1, LayerSplit(layout="Ett|tmm|L"))


@pytest.mark.parametrize("split,pp,vpp,layers,expected", [
    (LayerSplit(first=2), 2, 2, 6, [1, 2, 1, 2]),  # rank 0: 2 layers over its 2 chunks, rank 1: 4
    (LayerSplit(first=2, last=4), 3, 2, 10, [1, 2, 2, 1, 2, 2]),
    (LayerSplit(first=0), 2, 1, 4, [0, 4]),
    (LayerSplit(account_for_embedding=True, account_for_loss=True), 2, 2, 6, [1, 2, 2, 1]),
    (LayerSplit(account_for_loss=True), 4, 1, 7, [2, 2, 2, 1]),
])
def test_uneven_and_accounted_splits(split, pp, vpp, layers, expected):
    assert stage_sizes(layers, pp, vpp, split) == expected


@pytest.mark.parametrize("argv,fragment", [
    (["--pipeline-model-parallel-layout", "E|tt|tt|L", "--pipeline-model-parallel-size", "3"],
     "4 stages, not a multiple of --pipeline-model-parallel-size (3)"),
    (["--pipeline-model-parallel-layout", "tE|ttt|L", "--pipeline-model-parallel-size", "3"],
     "embedding E must come once, first in the first stage"),
    (["--pipeline-model-parallel-layout", "Et|ttt|Lt", "--pipeline-model-parallel-size", "3"],
     "loss L must come once, last in the last stage"),
    (["--pipeline-model-parallel-layout", "Et|txt|tL", "--pipeline-model-parallel-size", "3"], "unknown 'x'"),
    (["--pipeline-model-parallel-layout", "Et|tt|tL", "--pipeline-model-parallel-size", "3"],
     "places 4 transformer layers (t) but --num-layers is 5"),
    (["--pipeline-model-parallel-layout", "Et|tt|tt,m|L", "--pipeline-model-parallel-size", "4",
      "--mtp-num-layers", "1"], "(an m stage before the loss's, Megatron-Core's standalone MTP, is not supported)"),
    (["--pipeline-model-parallel-layout", "Et|tt|ttmL", "--pipeline-model-parallel-size", "3"],
     "places 1 multi-token prediction layers (m) but --mtp-num-layers is 0"),
    (["--pipeline-model-parallel-layout", "Et|tt|ttmL", "--pipeline-model-parallel-size", "3",
      "--mtp-num-layers", "2"], "places 1 multi-token prediction layers (m) but --mtp-num-layers is 2"),
    (["--pipeline-model-parallel-layout", "Et|tt|tmtL", "--pipeline-model-parallel-size", "3",
      "--mtp-num-layers", "1"], "after every transformer layer and just before L"),
    (["--pipeline-model-parallel-layout", "Ettt||ttL", "--pipeline-model-parallel-size", "3"],
     "virtual pipeline stage 1 (of 3) holds no transformer layer"),
    (["--pipeline-model-parallel-layout", "Et|tt|tt|L", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "2"], "drop --num-layers-per-virtual-pipeline-stage"),
    (["--pipeline-model-parallel-layout", "Ett|tttL", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "2"], "give one of them"),
    (["--decoder-first-pipeline-num-layers", "1", "--pipeline-model-parallel-size", "2",
      "--virtual-pipeline-model-parallel-size", "2"], "layers (1+4) must divide by 2"),
    (["--account-for-embedding-in-pipeline-split", "--pipeline-model-parallel-size", "2",
      "--virtual-pipeline-model-parallel-size", "2"], "num_layers (5) + 1 (embedding / loss counted as layers)"),
])
def test_impossible_layouts_are_one_line_errors(argv, fragment, monkeypatch, capsys):
    """pretrain_gpt refuses them before any process group: one `error:` line, exit code 2."""
    pp = int(argv[argv.index("--pipeline-model-parallel-size") + 1])
    monkeypatch.setenv("WORLD_SIZE", str(pp))
    monkeypatch.setenv("RANK", "0")
    assert pretrain_gpt.main(BASE + ["--num-layers", "5", "--global-batch-size", "8"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err, err


def _parity(layers, pp, flags):
    argv = BASE + ["--num-layers", str(layers)]
    ref = run_distributed(train_and_gather, 1, argv)
    results = run_distributed(train_and_gather, pp, argv + ["--pipeline-model-parallel-size", str(pp)] + flags)
    assert_same_run(records_of([r[0] for r in ref]), records_of([r[0] for r in results]), grad_norm_rtol=1e-6,
                    params=merged_params(results), ref_params=merged_params(ref))


def test_layout_with_embedding_and_loss_alone_at_pp2_vpp2_matches_single_process():
    """"E|tt|tt|L": rank 0 holds the embedding-only first stage and layers 2-3, rank 1 layers 0-1 and
    the loss-only last stage (the tied embedding summed across them), interleaved."""
    _parity(4, 2, ["--pipeline-model-parallel-layout", "E|tt|tt|L"])


@pytest.mark.slow
@pytest.mark.parametrize("layers,flags", [
    (4, ["--pipeline-model-parallel-layout", "Et|tttL", "--pipeline-schedule", "zb-h1"]),
    (4, ["--pipeline-model-parallel-layout", "Etttt|L", "--pipeline-schedule", "1f1b"]),
    (6, ["--decoder-first-pipeline-num-layers", "2", "--virtual-pipeline-model-parallel-size", "2"]),
    (6, ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
         "--virtual-pipeline-model-parallel-size", "2"]),
])
def test_every_kind_of_split_matches_single_process(layers, flags):
    _parity(layers, 2, flags)


def test_simulator_weighs_each_virtual_stage_by_its_layers():
    """1F1B, 2 ranks, 4 micro-batches, F = 1 and BW = 2 per unit of weight, the second stage 3 times
    the first: it is the bottleneck from its first F on, so the step is the first stage's F, the
    second's 4 x (3 + 6), then the first stage's last BW: 1 + 36 + 2 = 39 (15 with equal stages)."""
    from megatron_lite.parallel.pipeline.schedules import compute_orders
    from megatron_lite.parallel.pipeline.simulator import simulate

    orders = compute_orders("1f1b", 2, 4, 1)
    assert simulate(orders, costs=(1, 1, 1), comm="ideal").makespan == 15
    assert simulate(orders, costs=(1, 1, 1), comm="ideal", stage_weights=(1, 3)).makespan == 39


def test_planner_follows_the_layout(monkeypatch):
    """The planner's chunks and stage weights come from the layout the trainer runs."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    from megatron_lite.planning.layout import from_config
    from megatron_lite.planning.state import stage_chunks
    from megatron_lite.planning.timing import stage_weights
    from pretrain_gpt import resolve

    argv = BASE + ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                   "--pipeline-model-parallel-layout", "E|tt|tt|L"]
    cfg, _ = resolve(argv)
    lay = from_config(cfg, 2)
    assert lay.vpp == 2 and lay.pipeline_schedule == "interleaved"
    assert stage_chunks(4, lay, 0) == [((0, 0), True, False), ((2, 4), False, False)]
    assert stage_chunks(4, lay, 1) == [((0, 2), False, False), ((4, 4), False, True)]
    assert stage_weights(cfg.model, lay) == (0.0, 2.0, 2.0, 0.0)


def test_schedule_tool_replays_a_layout(capsys):
    """tools/pipeline_schedule.py weighs each stage by its layers: "E|tt|tt|L" interleaved over 2
    ranks runs the empty end stages in no time, so its makespan (32) exceeds the even split's (27)."""
    from tools.pipeline_schedule import main

    for argv, makespan in ((["--pipeline-model-parallel-layout", "E|(tt|)*2,L"], 32), (["--vpp", "2"], 27)):
        assert main(["--pp", "2", "--microbatches", "4", "--comm", "ideal"] + argv) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert "vpp 2" in first and first.endswith(f"makespan {makespan}"), first
