"""Activation memory at the formula: what autograd keeps per layer in bf16 (saved-tensor hooks,
tests/planner_harness.saved_per_layer) within 10 % of Korthikanti et al.'s count with flash-style
attention (planning/activations.formula_layer_bytes), for GPT- and Llama-style layers, with and
without TP and SP; and the planner's layer figure within 10 % of the measured one."""
import pytest

from megatron_lite.testing import run_distributed
from tests.planner_harness import LAYER_CELLS, LAYER_MODELS, saved_per_layer


@pytest.fixture(scope="module")
def cells():
    out = {}
    for world in (1, 2):
        chosen = [(m, extra) for m, extra in LAYER_CELLS if (2 if extra else 1) == world]
        got = run_distributed(saved_per_layer, world, [LAYER_MODELS[m] + extra for m, extra in chosen])[0]
        out.update({(m, " ".join(extra)): g for (m, extra), g in zip(chosen, got)})
    return out


def test_saved_bytes_per_layer_within_10_percent_of_the_formula(cells):
    assert len(cells) == len(LAYER_CELLS)
    for name, c in cells.items():
        assert abs(c["measured"] / c["formula"] - 1) < 0.10, (name, c)
        assert abs(c["planner"] / c["measured"] - 1) < 0.10, (name, c)


def test_gpt_layer_keeps_32_sbh_and_sp_divides_it_by_tp(cells):
    """Korthikanti's 34 s b h less the two hidden-dropout masks (dropout 0 here), plus the core's
    log-sum-exp; sequence parallelism splits the whole of it over the 2 TP ranks."""
    one, sp = cells[("GPT", "")], cells[("GPT", "--tensor-model-parallel-size 2 --sequence-parallel")]
    assert 32 <= one["measured"] / one["sbh"] < 32.5
    assert abs(sp["measured"] * 2 / one["measured"] - 1) < 0.02
