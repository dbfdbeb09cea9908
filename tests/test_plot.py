"""tools/plot.py: PNGs of the expected size whose plotted data are the metrics / the plan's bytes."""
import contextlib
import io
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from tools import plot  # noqa: E402
from tools import plan as plan_tool  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _metrics(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_metrics_curves_overlay_two_runs(tmp_path):
    a = [dict(iteration=i, lm_loss=5.0 - 0.1 * i, grad_norm=1.0 + i, lr=1e-3, tokens_per_sec=100.0 * i,
              step_time_s=0.1) for i in range(1, 6)]
    b = [dict(iteration=i, lm_loss=4.0 - 0.2 * i, grad_norm=None if i == 2 else 0.5 * i, tokens_per_sec=50.0 * i)
         for i in range(1, 4)]
    out = tmp_path / "curves.png"
    drawn = plot.plot_metrics([_metrics(tmp_path / "a.jsonl", a), _metrics(tmp_path / "b.jsonl", b)], str(out),
                              labels=["run a", "run b"])
    assert png_size(out) == (800, 600)
    assert drawn["run a"]["lm_loss"] == ([1, 2, 3, 4, 5], [r["lm_loss"] for r in a])
    assert drawn["run a"]["tokens_per_sec"] == ([1, 2, 3, 4, 5], [100.0, 200.0, 300.0, 400.0, 500.0])
    assert drawn["run b"]["grad_norm"] == ([1, 3], [0.5, 1.5])  # a missing value is left out, not drawn as 0


@pytest.mark.parametrize("extra", [[], ["--zero-stage", "3", "--zeropp-quantized-gradients",
                                         "--zeropp-qgz-error-feedback", "--zeropp-hpz-partition-size", "2"]])
def test_plan_memory_stacked_bars_sum_to_device_bytes(tmp_path, extra):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert plan_tool.main(["--model", "llama3-8b", "--bf16", "--pipeline-model-parallel-size", "2",
                               "--world-size", "8", "--gpu-memory", "120GB", "--json", *extra]) == 0
    plan = json.loads(buf.getvalue())
    out = tmp_path / "memory.png"
    parts = plot.plot_plan(plan, str(out))
    assert png_size(out) == (800, 600)
    ranks = plan["plan"]["ranks"]
    assert list(parts)[:4] == ["parameters", "gradients", "optimizer state", "activations"]
    assert parts["p2p buffers"] == [r["buffers"]["p2p"] / 2**30 for r in ranks]
    for i, r in enumerate(ranks):
        assert sum(p[i] for p in parts.values()) * 2**30 == pytest.approx(r["device_bytes"], rel=1e-12)
    if extra:  # qgZ's error feedback and hpZ's secondary partition have their own bars
        assert parts["error feedback"][0] > 0 and parts["hpZ secondary partition"][0] > 0


def test_cli_writes_png_and_refuses_bad_input_in_one_line(tmp_path):
    m = _metrics(tmp_path / "m.jsonl", [dict(iteration=1, lm_loss=3.0, grad_norm=1.0, tokens_per_sec=9.0)])
    run = lambda *a: subprocess.run([sys.executable, "tools/plot.py", *a], cwd=ROOT, capture_output=True,
                                    text=True, timeout=60)
    ok = run("--metrics-file", m, "--out", str(tmp_path / "c.png"))
    assert ok.returncode == 0 and png_size(tmp_path / "c.png") == (800, 600)
    for args, msg in ((("--metrics-file", str(tmp_path / "none.jsonl")), "No such file"),
                      (("--metrics-file", m, "--label", "a", "--label", "b"), "2 --label for 1 --metrics-file"),
                      ((), "pass either --metrics-file")):
        bad = run(*args, "--out", str(tmp_path / "x.png"))
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and msg in bad.stderr, bad.stderr
