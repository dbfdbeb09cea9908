"""FP8 recipes with state and blocks (megatron_lite/parallel/fp8_delayed.py, fp8_blocks.py):
delayed scaling's amax histories and scales against hand-computed values (roll, max vs
most_recent, margin, micro-batches folded once per step, zero amaxes), saturation under a stale
scale; blockwise scales per 1x128 tile / 128x128 block with padding, each GEMM equal to the fp32
GEMM of its dequantised operands and within e4m3 / e5m2 rounding of the fp32 GEMM, and beside
bf16's error; whole runs: delayed scaling at TP2+SP and DP2 equal the single process (the same
recipe state), the recipe state in checkpoints (bit-exact resume, FP8 <-> bf16, TP2 -> TP1, a
zero-bubble PP2 run's stages gathered -> PP1), --first-last-layers-bf16, blockwise at TP2+SP and
its one-line error."""
import os

import pytest
import torch

from megatron_lite.parallel.fp8 import Float8GemmPath, quantize
from megatron_lite.parallel.fp8_blocks import dequantize_blocks, quantize_blocks
from megatron_lite.parallel.fp8_delayed import DelayedScaling
from megatron_lite.testing import WorkerError, assert_same_run, run_distributed
from training_utils import LLAMA_SWITCHES, TINY, records_of

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = {"input": E4M3, "weight": E4M3, "grad": E5M2}


# --- delayed scaling: the recipe state ----------------------------------------------------------
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_history_and_scales_by_hand(algo):
    d = DelayedScaling(DTYPES, history_len=3, algo=algo, margin=1)
    assert d.scale_of("w", "input") is None  # nothing folded yet: current scaling
    steps = [(2.0, 0.5, 4.0), (8.0, 0.25, 1.0), (1.0, 0.5, 2.0), (4.0, 0.125, 0.0)]  # (input, weight, grad) amaxes
    for n, amaxes in enumerate(steps):
        d.before_step(n + 1)
        for role, a in zip(("input", "weight", "grad"), amaxes):
            d.observe("w", role, torch.tensor(a / 2))  # two micro-batches: the step keeps their max
            d.observe("w", role, torch.tensor(a))
        d.after_update()
    # newest first, three steps kept: the first step has rolled out
    assert d.history["w"].tolist() == [[4.0, 1.0, 8.0], [0.125, 0.5, 0.25], [0.0, 2.0, 1.0]]
    used = [8.0, 0.5, 2.0] if algo == "max" else [4.0, 0.125, None]
    # margin 1: fp8 max / amax / 2; the grad's newest amax is 0: it keeps the previous scale (amax 2)
    expect = [448 / used[0] / 2, 448 / used[1] / 2, 57344 / (used[2] or 2.0) / 2]
    assert d.scale["w"].tolist() == expect
    assert d.scale_of("w", "grad").item() == expect[2] and d.folds["w"] == 4
    d.before_step(5)  # a step's amaxes start from zero (a skipped update's are dropped)
    assert d.pending["w"].tolist() == [0.0, 0.0, 0.0]
    if algo == "most_recent":  # an amax whose scale would overflow fp32 keeps the previous scale
        d.fold("w", torch.tensor([1e-44, 4.0, 0.0]))
        assert d.scale["w"].tolist() == [expect[0], 56.0, expect[2]]


def test_delayed_state_round_trips_and_a_longer_history_keeps_the_newest():
    d = DelayedScaling(DTYPES, history_len=2, algo="max")
    for a in (1.0, 4.0):
        d.fold("layers.0.w", torch.tensor([a, a, a]))
    saved = d.state_dict()
    e = DelayedScaling(DTYPES, history_len=4, algo="max")
    assert e.load_state_dict(saved) == []
    assert e.scale_of("layers.0.w", "weight").item() == 448 / 4.0
    assert e.history["layers.0.w"][0].tolist() == [4.0, 1.0, 0.0, 0.0]
    assert e.load_state_dict(None) == ["the checkpoint has no FP8 delayed-scaling state: the amax histories start "
                                       "fresh"] and e.scale_of("layers.0.w", "weight") is None


def _named(w, name="w"):
    w.fp8_name = name
    return w


def test_delayed_gemm_uses_the_previous_steps_scale_and_saturates():
    path = Float8GemmPath(fmt="hybrid", recipe="delayed")
    x, w = torch.tensor([[1.0, -2.0], [0.5, 0.25]]), _named(torch.tensor([[0.5, 1.0], [-1.0, 0.25]]))
    path.delayed.before_step(1)
    y1 = path.forward(path.new_call(), x, w)  # first step: current scaling (exact here)
    torch.testing.assert_close(y1, x @ w.t(), rtol=0, atol=0)
    path.delayed.after_update()
    assert path.delayed.scale["w"].tolist() == [224.0, 448.0, 1.0]  # amax 2 and 1; no gradient seen
    path.delayed.before_step(2)
    call = path.new_call()
    y2 = path.forward(call, x * 4, w)  # 4x the amax the scale was made for: saturates at 448 / 224 = 2
    assert torch.equal(y2, torch.tensor([[2.0, -2.0], [2.0, 1.0]]) @ w.t())
    assert path.delayed.pending["w"][0].item() == 8.0  # ... and records the real amax for the next step
    g = path.input_grad(call, torch.zeros(2, 2), w)  # a zero gradient: zeros, scale kept
    assert not g.any()
    path.delayed.after_update()
    assert path.delayed.scale["w"].tolist() == [56.0, 448.0, 1.0]


# --- blockwise ----------------------------------------------------------------------------------
def test_block_scales_by_hand_with_padding():
    t = torch.zeros(3, 130)
    t[0, :128], t[0, 128:] = 2.0, 0.5
    t[1, 5] = -4.0  # row 2 is zero: scale 1
    q, inv = quantize_blocks(t, E4M3, (1, 128))
    assert inv.shape == (3, 2) and q.shape == (3, 130)
    assert torch.equal(inv, torch.tensor([[224.0, 896.0], [112.0, 1.0], [1.0, 1.0]]).reciprocal())
    assert torch.equal(dequantize_blocks(q, inv, (1, 128)), t)  # powers of two: exact
    w = torch.ones(200, 130)
    w[130:, 128:] = 8.0  # block (1, 1): rows 128..199 (padded to 256), columns 128..129
    q, inv = quantize_blocks(w, E4M3, (128, 128), margin=1)
    assert torch.equal(inv, torch.tensor([[224.0, 224.0], [224.0, 28.0]]).reciprocal())
    q, inv = quantize_blocks(torch.zeros(0, 130), E4M3, (128, 128))  # an expert with no tokens
    assert q.shape == (0, 130) and inv.shape == (0, 2)


def _operands(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[::7] *= 20  # outlier tokens
    return x, torch.randn(n, k, generator=g) * 0.02, torch.randn(m, n, generator=g) * 1e-3


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_blockwise_gemms_are_fp32_gemms_of_dequantised_blocks(fmt):
    x, w, g = _operands(136, 200, 144)  # no dimension a multiple of 128
    path = Float8GemmPath(fmt=fmt, recipe="blockwise")
    gdt = E5M2 if fmt == "hybrid" else E4M3
    tile, col, block = (1, 128), (128, 1), (128, 128)

    def deq(t, dtype, blk):
        return dequantize_blocks(*quantize_blocks(t, dtype, blk), blk)

    call = path.new_call()
    cases = [(path.forward(call, x, w), x, w.t(), E4M3, block),  # activations 1x128, weight 128x128 blocks
             (path.input_grad(call, g, w), g, w, gdt, block),  # gradients 1x128 along the output features
             (path.weight_grad(call, g, x), g.t(), x, gdt, col)]  # both along the tokens
    for got, a, b, adt, bblk in cases:
        torch.testing.assert_close(got, deq(a, adt, tile) @ deq(b, E4M3, bblk), rtol=1e-6, atol=1e-9)
        ua, ub = (0.125 if adt == E5M2 else 0.0625), 0.0625
        assert ((got - a @ b).abs() <= (ua + ub + ua * ub) * (a.abs() @ b.abs()) + 1e-9).all()
        # and of the bf16 GEMM, within both formats' rounding (bf16: 2^-9 per operand)
        bf16 = a.bfloat16().float() @ b.bfloat16().float()
        assert ((got - bf16).abs() <= (ua + ub + ua * ub + 2 * 2.0 ** -8) * (a.abs() @ b.abs()) + 1e-9).all()
    # where one token is 1e6 x the others, per-tensor scales push the rest into e4m3's subnormals; tiles do not
    x[3] *= 1e6
    ref = x @ w.t()
    tensorwise = Float8GemmPath(fmt=fmt, recipe="tensorwise")
    err = [((p.forward(p.new_call(), x, w) - ref)[4:].norm() / ref[4:].norm()).item() for p in (path, tensorwise)]
    assert err[0] < 0.05 < err[1], err


# --- whole runs -----------------------------------------------------------------------------------
DELAYED = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]


def _argv(extra=(), iters=3, fp8=DELAYED):
    return TINY[:TINY.index("--train-iters")] + ["--train-iters", str(iters)] + TINY[TINY.index("--train-iters") + 2:] \
        + LLAMA_SWITCHES + fp8 + list(extra)


def _losses(records):
    return [(r["lm_loss"], r["grad_norm"]) for r in records]


def train_with_recipe_state(rank, world, argv):
    """(records, the delayed-scaling state after training, the state as loaded from a checkpoint)."""
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    cfg, tokenizer = resolve(argv)
    trainer = make_trainer(cfg, tokenizer, torch.device("cpu"))
    delayed = getattr(trainer.gemm, "delayed", None)
    loaded = dict(delayed.loaded) if delayed is not None else None
    history = trainer.train()
    return history, (delayed.local_state() if delayed is not None else None), loaded


def _run(world, argv):
    """(records, recipe state, state as loaded): the states of all ranks' layers (pipeline stages)."""
    results = run_distributed(train_with_recipe_state, world, argv)
    states = [r[1] for r in results if r[1] is not None]
    state = {k: v for s in reversed(states) for k, v in s.items()} if states else None
    return records_of([r[0] for r in results]), state, results[0][2]


# After a step, layouts' weights differ by fp32 rounding; an element on an FP8 rounding boundary
# then moves by 2^-4 (e4m3) and can move an amax downstream by that much.
LATER_AMAX_RTOL = 7e-2


def _assert_same_state(got, ref, rtol, grad_factor=1.0, steps=slice(None)):
    """The same recipe state (the history's columns `steps`, newest first; the scales when all);
    output gradients `grad_factor` x the reference's (their scales 1 / grad_factor)."""
    assert sorted(got) == sorted(ref)
    factor = torch.tensor([[1.0], [1.0], [grad_factor]])
    for name in ref:
        assert got[name]["folds"] == ref[name]["folds"]
        hist, ref_hist = torch.tensor(got[name]["amax_history"]) / factor, torch.tensor(ref[name]["amax_history"])
        torch.testing.assert_close(hist[:, steps], ref_hist[:, steps], rtol=rtol, atol=0)
        if steps == slice(None):
            scale = torch.tensor(got[name]["scale"]) * factor[:, 0]
            torch.testing.assert_close(scale, torch.tensor(ref[name]["scale"]), rtol=rtol, atol=0)


@pytest.mark.parametrize("micro,layout", [([], ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                                          (["--micro-batch-size", "1"], [])], ids=["tp2-sp", "dp2"])
def test_delayed_layouts_equal_the_single_process(micro, layout):
    dp = 1 if layout else 2
    # the same micro-batches (current scaling's first step sees each one's amax), 1 or 2 ranks
    ref, ref_state, _ = _run(1, _argv(micro))
    assert sorted(ref_state) == sorted(f"layers.{i}.{n}.weight" for i in range(2) for n in (
        "self_attention.linear_q", "self_attention.linear_kv", "self_attention.linear_proj", "mlp.linear_fc1",
        "mlp.linear_fc2"))
    assert all(s["folds"] == 3 and min(s["amax_history"][r][2] for r in range(3)) > 0 for s in ref_state.values())
    got, state, _ = _run(2, _argv(micro + layout))
    # the TP ranks' amaxes are MAX-reduced (and DP's micro-batches folded) into the same state. Each DP
    # rank's backward sees dp x the single process's output gradients (a loss over 1/dp of the
    # micro-batches; the DP all-reduce averages): scales 1 / dp, the same FP8 values.
    assert_same_run(ref, got, rtol=1e-4, grad_norm_rtol=1e-6)
    _assert_same_state(state, ref_state, rtol=1e-5, grad_factor=dp, steps=slice(2, 3))  # the first step's amaxes
    _assert_same_state(state, ref_state, rtol=LATER_AMAX_RTOL, grad_factor=dp)  # TP's summation order flips too


def test_delayed_resume_is_bit_exact_and_reshards_tp2_to_tp1(tmp_path):
    straight, state, _ = _run(1, _argv(iters=4))
    ckpt = tmp_path / "ckpt"
    first, saved, _ = _run(1, _argv(["--save", str(ckpt), "--exit-interval", "2"], iters=4))
    second, resumed, loaded = _run(1, _argv(["--load", str(ckpt)], iters=4))
    assert loaded == saved  # the histories and scales come back ...
    assert _losses(first + second) == _losses(straight) and resumed == state  # ... and the run continues bit for bit
    tp2 = tmp_path / "tp2"
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    _, saved2, _ = _run(2, _argv(tp + ["--save", str(tp2), "--exit-interval", "2"], iters=4))
    rest, resumed1, loaded1 = _run(1, _argv(["--load", str(tp2)], iters=4))
    assert loaded1 == saved2  # by layer name: TP1 takes TP2's replicated state
    # TP's summation order only: it puts a few elements on the other side of an FP8 rounding boundary
    # (which ones depends on the CPU's fp32 kernels), and Adam carries them into the next gradients
    assert_same_run(straight[2:], rest, rtol=1e-4, grad_norm_rtol=1e-3)
    _assert_same_state(resumed1, state, rtol=LATER_AMAX_RTOL)


def test_delayed_pp2_zero_bubble_checkpoint_loads_at_pp1(tmp_path):
    """Each stage folds its own layers (the W pass's gradient amaxes too); a save gathers them."""
    straight, state, _ = _run(1, _argv(["--micro-batch-size", "1"], iters=4))
    pp = ["--micro-batch-size", "1", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"]
    first, saved, _ = _run(2, _argv(pp + ["--save", str(tmp_path), "--exit-interval", "2"], iters=4))
    rest, resumed, loaded = _run(1, _argv(["--micro-batch-size", "1", "--load", str(tmp_path)], iters=4))
    assert loaded == saved and len(saved) == 10  # both stages' layers, by name
    assert_same_run(straight, first + rest, rtol=1e-5)
    _assert_same_state(resumed, state, rtol=LATER_AMAX_RTOL)


def test_delayed_checkpoint_into_bf16_run_and_back(tmp_path, capfd):
    plain = _argv(iters=4, fp8=[])
    fp8, bf = tmp_path / "fp8", tmp_path / "bf16"
    _run(1, _argv(["--save", str(fp8), "--exit-interval", "2"], iters=4))
    capfd.readouterr()
    records, state, _ = _run(1, plain + ["--load", str(fp8)])
    assert state is None and len(records) == 2
    note = "the checkpoint's FP8 delayed-scaling state (amax histories) is not used by this run"
    assert note in capfd.readouterr().out
    _run(1, plain + ["--save", str(bf), "--exit-interval", "2"])
    capfd.readouterr()
    records, state, loaded = _run(1, _argv(["--load", str(bf)], iters=4))
    assert "the checkpoint has no FP8 delayed-scaling state: the amax histories start fresh" in capfd.readouterr().out
    assert loaded == {} and len(records) == 2 and all(s["folds"] == 2 for s in state.values())


def test_first_last_layers_bf16(capfd):
    """Every layer kept out of FP8 is the plain run exactly; 1 of 3 at each end leaves layer 2."""
    three = ["--num-layers", "3"]
    ref, _, _ = _run(1, _argv(three, iters=2, fp8=[]))
    bf16 = ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2"]
    got, state, _ = _run(1, _argv(three + bf16 + ["--num-layers-at-end-in-bf16", "1"], iters=2))
    assert _losses(got) == _losses(ref) and state == {}
    capfd.readouterr()
    got, state, _ = _run(1, _argv(three + ["--first-last-layers-bf16"], iters=2))
    assert sorted({name.split(".")[1] for name in state}) == ["1"] and _losses(got) != _losses(ref)
    assert ("(QKV, projection, fc1, fc2) of layers 2-2 of 3 (first 1 and last 1 in float32); embedding"
            in capfd.readouterr().out)


def test_blockwise_tp2_sp_equals_the_single_process():
    # 128-wide shards: per rank one query head of 128 channels, one KV group, 128 FFN channels
    wide = ["--hidden-size", "128", "--num-attention-heads", "2", "--kv-channels", "128", "--ffn-hidden-size", "256",
            "--num-query-groups", "2"]
    argv = _argv(wide, iters=2, fp8=["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"])
    ref, _, _ = _run(1, argv)
    got, _, _ = _run(2, argv + ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert got[0]["lm_loss"] == ref[0]["lm_loss"]  # the same blocks: the first forward to the bit
    # Backward: TP's partial input gradients are summed in another order, and an element that lands
    # on the other side of an FP8 rounding boundary moves by 2^-3 (e5m2): the first gradient norm
    # agrees to 1e-4 (tensorwise at this shape: 2e-5, measured), not to fp32 rounding; Adam turns that
    # into 1e-3 in the next gradient norm, 1e-4 in the next loss.
    assert abs(got[0]["grad_norm"] / ref[0]["grad_norm"] - 1) < 1e-4
    assert_same_run([r["lm_loss"] for r in ref], [r["lm_loss"] for r in got], rtol=1e-4)


def test_blockwise_tp_shards_cutting_blocks_are_one_line():
    argv = _argv(["--tensor-model-parallel-size", "2"], fp8=["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"])
    with pytest.raises(WorkerError) as e:
        run_distributed(train_with_recipe_state, 2, argv)
    assert ("ConfigError: --fp8-recipe blockwise at --tensor-model-parallel-size 2: the TP shards of "
            "layers.0.self_attention.linear_q.weight (32 along dimension 0) cut its 128x128 blocks; use sizes whose "
            "TP shards are multiples of 128, or --fp8-recipe tensorwise / rowwise / delayed") in str(e.value)


def test_first_last_layers_bf16_keeps_their_experts_too():
    from test_fp8 import _Seen
    from test_gemm_path import GEMM_WEIGHTS, _backward, _moe_model
    gemm = _Seen()
    model = _moe_model(gemm, grouped=False)
    gemm.bind([model], (1, 0), 2)  # the first of 2 layers stays precise
    _backward(model)
    names = {n for n, p in model.named_parameters() if any(w is p or w._base is p for w in gemm.seen)}
    assert names == {n for n in GEMM_WEIGHTS if n.startswith("layers.1.")}
    assert "of layers 2-2 of 2 (first 1 and last 0 in float32)" in gemm.describe(torch.float32, [True, True])
