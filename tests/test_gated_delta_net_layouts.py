"""Hybrid models of Gated DeltaNet / Kimi Delta Attention and full-attention layers through the training
loop: every layout trains like the single process (losses 1e-5, first grad norm 1e-6, final weights
1e-4), the loss falls, and the flags' one-line errors."""
import pytest

from test_mla import _assert_like_single
from training_utils import LLAMA_SWITCHES, TINY, assert_one_line_error, single_process_reference

LINEAR = ["--experimental-attention-variant", "gated_delta_net", "--linear-num-key-heads", "2",
          "--linear-num-value-heads", "4", "--linear-key-head-dim", "8", "--linear-value-head-dim", "12",
          "--linear-chunk-size", "16", "--linear-conv-kernel-dim", "3"]
GDN = TINY + LLAMA_SWITCHES + LINEAR + ["--linear-attention-freq", "2"]  # layer 0 linear, layer 1 full
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
    "gdn-tp2-sp-pp2": (GDN, 4, TP_SP + ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]),
    "gdn-tp2-dp2-zero3": (GDN, 4, ["--tensor-model-parallel-size", "2", "--zero-stage", "3",
                                   "--global-batch-size", "8"]),
}
FAST = ("gdn-tp2-sp",)


@pytest.mark.parametrize("layout", [name if name in FAST else pytest.param(name, marks=pytest.mark.slow)
                                    for name in LAYOUTS])
def test_hybrid_layout_trains_like_single_process(layout):
    model, world, extra = LAYOUTS[layout]
    _assert_like_single(model, world, extra)
    ref = single_process_reference(model + _shape_flags(extra))[0]  # (cached: the run just compared)
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"] - 0.3  # it learns
