"""The fake-CUDA dry run (tools/fake_cuda.py, tools/fake_cuda_dry_run.py): one training step with
--device cuda completes without a GPU for bf16 and each FP8 recipe, CUDA's operator rules are
enforced (so the dry run catches their violations), and nothing stays patched afterwards."""
import functools
import multiprocessing
import os
import traceback

import pytest
import torch

from tools.cuda_branches import BranchRecorder, branch_sites
from tools.fake_backward import backward as python_backward
from tools.fake_cuda import fake_cuda
from tools.fake_cuda_dry_run import RECIPES, dry_run, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _own_process(test):
    """Run the test in a forked process: the dry run lends a device guard in c10's registry and
    touches torch's process-wide state, which restoring the Python patches does not undo (a later
    MoE parity test in the same process trained differently). Nothing reaches the tests after it."""
    @functools.wraps(test)
    def forked(*args, **kwargs):
        ctx = multiprocessing.get_context("fork")
        receive, send = ctx.Pipe(duplex=False)

        def child():
            try:
                test(*args, **kwargs)
                send.send(None)
            except BaseException:
                send.send(traceback.format_exc())

        process = ctx.Process(target=child)
        process.start()
        failure = receive.recv() if receive.poll(1200) else "the test's process gave no answer in 1200 s"
        process.join(60)
        assert failure is None, failure
    return forked


@pytest.fixture(autouse=True)
def _single_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")


def _scaled_mm(b_column_major: bool):
    a = torch.empty(32, 64, device="cuda", dtype=torch.float8_e4m3fn)
    b = torch.empty(64, 48, device="cuda", dtype=torch.float8_e4m3fn)
    if b_column_major:
        b = b.t().contiguous().t()
    one = torch.ones((), device="cuda")
    return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


@_own_process
def test_scaled_mm_rules_are_enforced_under_the_dry_run():
    with fake_cuda():
        out = _scaled_mm(b_column_major=True)
        assert out.shape == (32, 48) and out.is_cuda and out.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="column_major|col_major|column-major"):
            _scaled_mm(b_column_major=False)  # the mistake the dry run exists to catch
        with pytest.raises(RuntimeError, match="row_major"):  # a column-major left operand
            torch._scaled_mm(torch.empty(64, 32, device="cuda", dtype=torch.float8_e4m3fn).t(),
                             torch.empty(48, 64, device="cuda", dtype=torch.float8_e4m3fn).t(),
                             scale_a=torch.ones((), device="cuda"), scale_b=torch.ones((), device="cuda"),
                             out_dtype=torch.bfloat16)


@_own_process
def test_one_training_step_per_recipe_completes_under_fake_cuda():
    """Forward, backward and optimizer step of a model with multi-latent attention, bf16 and every
    FP8 recipe. (FP8's weight gradient was refused on CUDA before fp8.scaled_mm made its left
    operand row-major.)"""
    recorder = BranchRecorder(os.path.join(ROOT, "megatron_lite"))
    results = dry_run(["mla-tiny"], RECIPES, recorder=recorder)
    assert results == {("mla-tiny", r): [] for r in RECIPES}
    reached = {(os.path.relpath(f, ROOT), n) for f, n in recorder.reached}
    assert any(f == os.path.join("megatron_lite", "parallel", "fp8.py") for f, _ in reached)  # the CUDA GEMM
    assert any(f.endswith(os.path.join("parallel", "random.py")) for f, _ in reached)  # the CUDA RNG tracker
    assert recorder.not_reached()  # TE, flash-attn, NCCL start-up, ... are listed too


@_own_process
def test_activation_offload_and_the_distributed_optimizer_under_fake_cuda():
    """Activation offload's CUDA side (pinned host buffers, side-stream copies, events) and ZeRO-1 with
    the optimizer state in host memory, in one FP8 step: collectives over fake tensors on a gloo world
    of one process go through."""
    extra = ["--cpu-offloading", "--cpu-offloading-num-layers", "1", "--use-distributed-optimizer",
             "--optimizer-cpu-offload"]
    recorder = BranchRecorder(os.path.join(ROOT, "megatron_lite"))
    assert dry_run(["mla-tiny"], ["tensorwise"], extra, recorder) == {("mla-tiny", "tensorwise"): []}
    reached = {os.path.basename(f) for f, _ in recorder.reached}
    assert {"offload.py", "state_store.py"} <= reached  # the host-held optimizer state (optim/state_store.py)


@_own_process
def test_the_dry_run_names_a_column_major_left_operand(monkeypatch):
    """The weight-gradient bug as it was: the step fails and the finding names it."""
    import megatron_lite.parallel.fp8 as fp8

    def old_scaled_mm(qa, qb, sa, sb, out_dtype):
        if qa.device.type == "cpu":
            return ((qa.float() * sa) @ (qb.float() * sb)).to(out_dtype)
        return torch._scaled_mm(qa, qb.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)

    monkeypatch.setattr(fp8, "scaled_mm", old_scaled_mm)
    [finding] = dry_run(["mla-tiny"], ["tensorwise"])[("mla-tiny", "tensorwise")]
    assert "row_major" in finding


@pytest.mark.slow
@_own_process
def test_the_1p3b_step_completes_under_fake_cuda():
    assert dry_run(["llama-1.3b"], RECIPES) == {("llama-1.3b", r): [] for r in RECIPES}


@_own_process
def test_nothing_stays_behind():
    def state():
        return (torch.cuda.is_available(), torch.Tensor.backward, torch.Tensor.record_stream, torch.Generator,
                torch.utils.swap_tensors, torch.cuda.Stream, torch.cuda.get_rng_state, torch.cuda.synchronize)

    before = state()
    with pytest.raises(ZeroDivisionError):
        with fake_cuda():
            assert torch.cuda.is_available() and torch.empty(4, device="cuda")[1:3].shape == (2,)
            1 / 0  # an error inside restores everything too
    assert state() == before
    if not torch.cuda._is_compiled():
        with pytest.raises(Exception):
            torch.empty(4, device="cuda")


@_own_process
def test_swap_in_keeps_a_fake_tensors_device():
    """tiled_init.swap_in gives a meta parameter its storage; a tensor subclass's own state (here a
    fake tensor's device) is the new tensor's, not the meta parameter's (found by the dry run)."""
    from megatron_lite.parallel.tiled_init import swap_in

    with fake_cuda():
        p = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
        p.shard_spec = "kept"
        swap_in(p, torch.empty(16, device="cuda", dtype=torch.bfloat16).view(4, 4))
        assert p.device.type == "cuda" and not p.is_meta and p.dtype == torch.bfloat16 and p.shard_spec == "kept"


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
        y = _Scale.apply(model(x), scale)  # a broadcast operand, a split, a slice, a Python node
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


def test_branch_sites():
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("def f(t):\n    if t.device.type == 'cpu':\n        return 1\n    return 2 if t.is_cuda else 3\n")
    try:
        assert branch_sites(f.name) == [2, 4]
    finally:
        os.unlink(f.name)


@pytest.mark.parametrize("argv,message", [(["--recipes", "fp4"], "unknown recipe(s) fp4"),
                                          (["--models", "gpt5"], "unknown model(s) gpt5")])
def test_cli_refuses_unknown_names(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
