"""FAILING REPRODUCTIONS from the new-user trial of issue 25's features (branch newuser): each test
states the behaviour the README promises and currently fails. Not fixes; see the trial's report."""
from megatron_lite.testing import run_distributed
from test_zero_one_adam import ZO_CKPT, _memory_after_training


def test_zero_one_adam_nvme_memory_line_matches_what_is_held(tmp_path):
    """BUG (fails today): with --optimizer adam-01 --optimizer-offload-nvme-path the start-up
    memory line counts 0/1 Adam's anchor in the NVMe file and its staging buffers
    (optimizer_nvme_bytes 2.2 MiB at DP2 on the tiny model), while the file holds only main, m and v
    (the `> optimizer state on NVMe:` line says 1.6 MiB) and the anchor is a tensor in memory
    (optimizer_state_bytes). README: the line's figures equal the tensors held."""
    argv = ZO_CKPT + ["--optimizer-offload-nvme-path", str(tmp_path / "nvme")]
    accounted, held = run_distributed(_memory_after_training, 2, argv, timeout=240)[0]
    for key in ("optimizer_state_bytes", "optimizer_nvme_bytes", "optimizer_staging_bytes"):
        assert accounted.get(key) == held.get(key), (key, accounted.get(key), held.get(key))


_HOLDER = """
import sys
from megatron_lite.parallel.nvme_file import NvmeFile, aligned_buffer
f = NvmeFile(sys.argv[1], "optimizer-state", 0, 4096, "--optimizer-offload-nvme-path", "optimizer state")
buf = aligned_buffer(4096, False)
buf.fill_(7)
f.io(True, buf, 0)
print("ready", flush=True)
sys.stdin.readline()
buf.zero_()
f.io(False, buf, 0)
print(int(buf.min()), int(buf.max()), flush=True)
"""


def test_a_second_job_on_the_same_nvme_dir_does_not_overwrite_the_first(tmp_path):
    """BUG (fails today): two jobs on one node given the same --optimizer-offload-nvme-path (or
    --param-offload-nvme-path) both open `optimizer-state-rank00000.bin` with O_TRUNC and read and
    write the same file: each silently trains on the other's optimizer state (a 60-iteration run
    beside another ended at loss 2.78 instead of 3.42, no message). Expected: the second job refuses
    the directory in one line, or uses a file of its own; never the first job's bytes."""
    import os
    import subprocess
    import sys
    from megatron_lite.errors import ConfigError
    from megatron_lite.parallel.nvme_file import NvmeFile, aligned_buffer
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "ready"
        try:
            second = NvmeFile(str(tmp_path), "optimizer-state", 0, 4096, "--optimizer-offload-nvme-path",
                              "optimizer state")
        except ConfigError:
            return  # refused in one line: fine
        buf = aligned_buffer(4096, False)
        buf.fill_(1)
        second.io(True, buf, 0)
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().split() == ["7", "7"], "the first job's optimizer file was overwritten"
    finally:
        holder.kill()
        holder.wait()
