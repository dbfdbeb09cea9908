"""The fake-CUDA dry run (tools/fake_cuda.py, tools/fake_cuda_dry_run.py): CUDA's operator rules
are enforced without a GPU, the FP8 GEMMs pass them, and nothing stays patched afterwards."""
import pytest
import torch

from tools.cuda_branches import BranchRecorder, branch_sites
from tools.fake_backward import backward as python_backward
from tools.fake_cuda import fake_cuda
from tools.fake_cuda_dry_run import RECIPES, dry_run, main

SMALL = dict(tokens=256, hidden=128, ffn=256)


def _fp8_pair(b_column_major: bool):
    a = torch.empty(32, 64, device="cuda", dtype=torch.float8_e4m3fn)
    b = torch.empty(64, 48, device="cuda", dtype=torch.float8_e4m3fn)
    if b_column_major:
        b = b.t().contiguous().t()
    one = torch.ones((), device="cuda")
    return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def test_scaled_mm_rules_are_enforced_under_the_dry_run():
    with fake_cuda():
        out = _fp8_pair(b_column_major=True)
        assert out.shape == (32, 48) and out.is_cuda and out.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="column_major|col_major|column-major|row_major"):
            _fp8_pair(b_column_major=False)  # the mistake the dry run exists to catch
        a = torch.empty(30, 64, device="cuda", dtype=torch.float8_e4m3fn)  # not a multiple of 16
        b = torch.empty(48, 64, device="cuda", dtype=torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        with pytest.raises(RuntimeError):
            torch._scaled_mm(a.t().contiguous().t()[:, :62], b[:62], scale_a=one, scale_b=one,
                             out_dtype=torch.bfloat16)


def test_every_recipe_passes_the_dry_run():
    """Forward, input and weight gradient of each GEMM of a layer, for bf16 and each FP8 recipe. The
    weight gradient's left operand (a transposed gradient) was refused before fp8.scaled_mm made it
    row-major."""
    results = dry_run(RECIPES, **SMALL)
    assert results == {r: [] for r in RECIPES}


def test_the_dry_run_reports_a_column_major_left_operand(monkeypatch):
    """The weight-gradient bug as it was: the dry run names it (so it would catch it again)."""
    import megatron_lite.parallel.fp8 as fp8

    def old_scaled_mm(qa, qb, sa, sb, out_dtype):
        return torch._scaled_mm(qa, qb.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)

    monkeypatch.setattr(fp8, "scaled_mm", old_scaled_mm)
    findings = dry_run(["tensorwise"], **SMALL)["tensorwise"]
    assert findings and all("weight_grad" in f and "row_major" in f for f in findings)
    assert len(findings) == 4  # qkv, proj, fc1, fc2


def test_nothing_stays_behind():
    before = (torch.cuda.is_available(), torch.Tensor.backward, torch.Generator, torch.utils.swap_tensors,
              torch.cuda.Stream, torch.cuda.get_rng_state)
    with fake_cuda():
        assert torch.cuda.is_available() and torch.empty(4, device="cuda")[1:3].shape == (2,)
    after = (torch.cuda.is_available(), torch.Tensor.backward, torch.Generator, torch.utils.swap_tensors,
             torch.cuda.Stream, torch.cuda.get_rng_state)
    assert after == before
    if not torch.cuda._is_compiled():
        with pytest.raises(Exception):
            torch.empty(4, device="cuda")


class _Scale(torch.autograd.Function):  # a Python autograd node in the graph, as the layers have
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum_to_size(w.shape)


def test_python_backward_matches_the_engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 6))
    scale = torch.nn.Parameter(torch.randn(6))
    x = torch.randn(5, 8)

    def loss():
        y = _Scale.apply(model(x), scale)
        a, b = y.split(3, dim=1)
        return (a * b).sum() + a.pow(2).mean() + y[:, :2].sum()

    params = list(model.parameters()) + [scale]
    loss().backward()
    ref = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    hooked = []
    scale.register_post_accumulate_grad_hook(lambda p: hooked.append(p.grad.clone()))
    python_backward(loss())
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-6, atol=1e-7)
    assert len(hooked) == 1 and torch.equal(hooked[0], ref[-1])


def test_a_training_style_backward_runs_on_fake_cuda():
    with fake_cuda():
        w = torch.nn.Parameter(torch.empty(64, 32, device="cuda", dtype=torch.bfloat16))
        x = torch.empty(16, 32, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(2, 4, 16, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        (x @ w.t()).float().sum().backward()
        out.sum().backward()
        assert w.grad.shape == w.shape and w.grad.is_cuda and q.grad.shape == q.shape


def test_branch_recorder_sees_the_fp8_device_branch(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(t):\n    if t.device.type == 'cpu':\n        return 1\n    return 2 if t.is_cuda else 3\n")
    assert branch_sites(str(src)) == [2, 4]
    import megatron_lite
    import os
    recorder = BranchRecorder(os.path.dirname(megatron_lite.__file__))
    dry_run(["tensorwise"], **SMALL, recorder=recorder)
    reached = {(os.path.basename(f), n) for f, n in recorder.reached}
    assert any(name == "fp8.py" for name, _ in reached)
    assert recorder.not_reached()  # the Trainer's branches, TE, flash-attn, ...


def test_cli_refuses_an_unknown_recipe(capsys):
    assert main(["--recipes", "fp4"]) == 2
    assert "unknown recipe(s) fp4" in capsys.readouterr().err
