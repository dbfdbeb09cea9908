"""Pipeline parallelism beyond even splits: uneven first/last stages, the tied GPT-2 embedding
across stages, and PP combined with TP + sequence parallelism. Each layout must reproduce the
single-process run (losses and final parameters)."""
import pytest
import torch

from megatron_lite.testing import assert_same_run, run_distributed
from training_utils import LLAMA_SWITCHES, merged_params, records_of, train_and_gather

BASE = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--train-iters", "5", "--device", "cpu", "--attention-dropout", "0", "--hidden-dropout", "0", "--lr", "3e-3",
        "--eval-iters", "1", "--eval-interval", "5"]


def _train_keeping_tied_copies(rank, world, argv):
    """train_and_gather, plus this rank's copies of the tied word embedding (first stage: the
    embedding, last stage: the output layer), which train_and_gather leaves out on the last."""
    from megatron_lite.parallel.sharding import gather_full, spec_of
    from megatron_lite.training.loop import Trainer

    seen = {}
    train = Trainer.train

    def train_and_keep(self):  # patched in this forked rank only
        seen["trainer"] = self
        return train(self)

    Trainer.train = train_and_keep
    out = train_and_gather(rank, world, argv)
    trainer = seen["trainer"]
    tied = {("first" if chunk.pre_process else "last"): gather_full(p.data, p, trainer.dims)
            for chunk in trainer.chunks for p in chunk.parameters() if spec_of(p).tie is not None}
    return out + (tied,)


_REFS = {}


def _reference(argv):
    key = tuple(argv)
    if key not in _REFS:
        results = run_distributed(train_and_gather, 1, argv)
        _REFS[key] = (records_of([r[0] for r in results]), merged_params(results))
    return _REFS[key]


def _assert_matches(results, ref):
    ref_records, ref_params = ref
    assert_same_run(ref_records, records_of([r[0] for r in results]), grad_norm_rtol=1e-6,
                    params=merged_params(results), ref_params=ref_params)


@pytest.mark.parametrize("pp,layers,split,schedule", [
    (2, 4, ["--decoder-first-pipeline-num-layers", "1"], "1f1b"),  # 1 + 3
    (4, 6, ["--decoder-first-pipeline-num-layers", "0", "--decoder-last-pipeline-num-layers", "2"], "zb-h1"),  # 0+2+2+2
    (4, 6, ["--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "0"], "gpipe"),  # 2+2+2+0
])
def test_uneven_stages_match_single_process_and_keep_tied_embedding_equal(pp, layers, split, schedule):
    argv = BASE + ["--num-layers", str(layers)]
    results = run_distributed(_train_keeping_tied_copies, pp, argv + split + [
        "--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", schedule])
    _assert_matches([r[:4] for r in results], _reference(argv))
    # GPT-2 ties the output layer to the word embedding: the two stages' copies stay identical.
    first = [r[4]["first"] for r in results if "first" in r[4]]
    last = [r[4]["last"] for r in results if "last" in r[4]]
    assert len(first) == 1 and len(last) == 1, "expected one embedding copy on the first and one on the last stage"
    assert torch.equal(first[0], last[0]), f"tied copies differ by {(first[0] - last[0]).abs().max().item():.3e}"
    assert not torch.equal(first[0], _initial_embedding(argv)), "the embedding did not train"


def _initial_embedding(argv):
    from models.gpt import WORD_EMBEDDINGS, build_model
    from megatron_lite.parallel.state import ParallelDims
    from pretrain_gpt import resolve
    cfg, _ = resolve(argv)
    model = build_model(cfg.model, ParallelDims(), seed=cfg.training.seed)[0]
    return dict(model.named_parameters())[WORD_EMBEDDINGS].detach()


def test_llama_tp2_pp2_sequence_parallel_matches_single_process():
    argv = BASE + LLAMA_SWITCHES + ["--num-layers", "4"]
    results = run_distributed(train_and_gather, 4, argv + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"])
    _assert_matches(results, _reference(argv))


@pytest.mark.parametrize("first,last,fragment", [
    (2, 2, "no layer for the 2 middle"),  # 4 layers on 4 stages as 2+0+0+2: middle stages with no parameters
    (-1, None, "(-1) must be >= 0"),
])
def test_impossible_uneven_splits_are_config_errors(first, last, fragment):
    from megatron_lite.errors import ConfigError
    from megatron_lite.parallel.pipeline.partition import LayerSplit, stage_layer_ranges
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        stage_layer_ranges(4, 4, 1, LayerSplit(first, last))
