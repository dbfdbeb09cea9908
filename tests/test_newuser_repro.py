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
