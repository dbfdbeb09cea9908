"""MoE parallel folding (Megatron-Core's rule): the expert grid ETP x EP x EDP folds over the ranks
of the attention grid TP x CP x DP independently, TP ranks first, so EP may span the TP (and CP)
ranks of a replica. Each folded layout trains like the single-process run (losses, grad norms,
router statistics), also with ZeRO-1/3 sharding expert state over EDP, and a checkpoint written
at a folded layout resumes at another layout and at one process."""
import pytest

from megatron_lite.arguments import parse_args
from megatron_lite.errors import ConfigError
from megatron_lite.testing import assert_same_run, run_distributed
from models.zoo import zoo
from test_moe_training import A2A, BASE, BIAS, _assert_like_single_process, _reference
from training_utils import records_of, train_in_process

TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EP2, EP4 = ["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "4"]
FOLDED = {  # name: layout flags (4 ranks)
    # EP over the two TP ranks of each of two DP replicas
    "tp2-ep4-sp-a2a": TP2_SP + EP4 + A2A,
    "tp2-ep4-sp-allgather": TP2_SP + EP4,
    "tp2-ep4-nosp-a2a": ["--tensor-model-parallel-size", "2"] + EP4 + A2A,  # each TP rank routes its slice
    # EP over the TP x CP ranks of the one replica
    "tp2-cp2-ep4-sp-a2a": TP2_SP + ["--context-parallel-size", "2"] + EP4 + A2A,
    # expert TP 2 inside TP 4, EP over the two ETP pairs
    "tp4-etp2-ep2-sp-a2a": ["--tensor-model-parallel-size", "4", "--sequence-parallel",
                            "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"] + A2A,
    # expert TP over data-parallel ranks (no dense TP)
    "dp4-etp2-ep2-a2a": ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"] + A2A,
    # ZeRO over EDP: EP over the TP ranks, the two DP replicas are expert-data-parallel (EDP 2)
    "tp2-ep2-edp2-zero1": TP2_SP + EP2 + A2A + ["--zero-stage", "1"],
    "tp2-ep2-edp2-zero2": TP2_SP + EP2 + A2A + ["--zero-stage", "2"],
    "tp2-ep2-edp2-zero3": TP2_SP + EP2 + ["--zero-stage", "3"],
    "tp2-cp2-ep2-edp2-zero1": TP2_SP + ["--context-parallel-size", "2"] + EP2 + A2A + ["--zero-stage", "1"],
    "tp2-ep4-zero3": TP2_SP + EP4 + ["--zero-stage", "3"],
    # with pipelines: each stage folds its own expert grid (EP over the stage's TP ranks)
    "pp2-tp2-ep2-1f1b": TP2_SP + EP2 + A2A + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"],
    "tp4-etp2-ep2-zero3": ["--tensor-model-parallel-size", "4", "--sequence-parallel",
                           "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2",
                           "--zero-stage", "3"] + A2A,
}
DEFAULT = ("tp2-ep4-sp-a2a", "tp2-cp2-ep4-sp-a2a", "tp4-etp2-ep2-sp-a2a", "tp2-ep2-edp2-zero1", "tp2-ep2-edp2-zero3")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in FOLDED])
def test_folded_expert_layouts_train_like_single_process(name):
    _assert_like_single_process(BASE, 4, FOLDED[name])


@pytest.mark.parametrize("resume,world", [
    pytest.param(["--expert-model-parallel-size", "2"], 4, marks=pytest.mark.slow),  # EP over DP replicas, TP 1
    pytest.param(TP2_SP + EP4, 4, marks=pytest.mark.slow),  # EP over TP x DP, EDP 1
    (["--tensor-model-parallel-size", "4", "--sequence-parallel", "--expert-model-parallel-size", "2",
      "--expert-tensor-parallel-size", "2"], 4),
    pytest.param([], 1, marks=pytest.mark.slow),
], ids=["to-dp4-ep2", "to-tp2-ep4", "to-tp4-etp2-ep2", "to-single-process"])
def test_folded_checkpoint_resumes_at_other_layouts(tmp_path, resume, world):
    """Written at TP2 x EP2 x EDP2 (EP over the TP ranks, the distributed optimizer sharding expert
    state over EDP), with the expert bias; resumed elsewhere, the run continues exactly as the
    straight single-process run."""
    argv = BASE + BIAS + ["--use-distributed-optimizer", "--train-iters", "6", "--lr-decay-iters", "6"]
    straight = _reference(argv)
    flags = argv + ["--save", str(tmp_path / "ckpt")]
    first = records_of(run_distributed(train_in_process, 4, flags + TP2_SP + EP2 + A2A + ["--exit-interval", "3"]))
    second = records_of(run_distributed(train_in_process, world, flags + resume))
    assert [r["iteration"] for r in first + second] == list(range(1, 7))
    assert_same_run(straight, first + second, rtol=1e-5)


@pytest.mark.parametrize("extra,needle", [
    (["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "8"],
     "expert grid does not fit: expert_tensor_parallel_size (1) x expert_model_parallel_size (8) must divide the 4 "
     "ranks of a pipeline stage"),
    (["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "2"],
     "expert_tensor_parallel_size (2) x expert_model_parallel_size (4) must divide the 4 ranks"),
    (["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "4"],
     "must divide the 2 ranks of a pipeline stage"),
    (["--expert-tensor-parallel-size", "0"], "expert_tensor_parallel_size (0) must be >= 1"),
])
def test_expert_grids_that_do_not_fit_are_one_line_errors(extra, needle):
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + extra, zoo()).finalize(4).validate(4)
    assert needle in str(err.value) and "\n" not in str(err.value)
