"""The slow tier's rotation (slow_rotation.py, conftest's --slow-slice): slices are disjoint, cover
every slow test, are balanced by the recorded durations, place an unrecorded test without moving
another, and follow main's first-parent line so that N consecutive commits run every slice."""
import os
import shutil
import subprocess
import sys

import pytest

from slow_rotation import Rotation, balance, commit_slice, durations_of_log, hashed_slice, parse_slice

HERE = os.path.dirname(os.path.abspath(__file__))


def test_balance_covers_every_test_once_and_evens_the_slices():
    durations = {f"t.py::test_{i}": float(d) for i, d in enumerate([30, 1, 7, 7, 2, 12, 5, 5, 3, 9, 0.5, 20])}
    slices = balance(durations, 4)
    assert sorted(slices) == sorted(durations) and set(slices.values()) == {0, 1, 2, 3}
    loads = sorted(sum(d for t, d in durations.items() if slices[t] == k) for k in range(4))
    assert loads == [23.5, 24.0, 24.0, 30.0]  # the longest test alone; the other 71.5 s in three even parts


def test_an_unrecorded_test_takes_its_hash_slice_and_moves_no_other():
    durations = {f"t.py::test_{i}": float(i + 1) for i in range(20)}
    before = Rotation(6, durations)
    after = Rotation(6, durations)
    new = "t.py::test_new[a]"
    assert after.slice_of(new) == hashed_slice(new, 6) == Rotation(6, {}).slice_of(new)
    assert all(before.slice_of(t) == after.slice_of(t) for t in durations)
    assert len({hashed_slice(f"t.py::test_{i}", 6) for i in range(100)}) == 6  # the hash spreads


@pytest.mark.parametrize("spec", ["0/6", "7/6", "2", "a/b", "", "2/0"])
def test_a_bad_slice_is_refused(spec):
    with pytest.raises(ValueError, match="expected K/N"):
        parse_slice(spec)


def test_durations_of_a_pytest_log_add_setup_call_and_teardown():
    log = ["=== slowest durations ===", "3.50s call     tests/a.py::test_x[p-1]", "0.25s setup    tests/a.py::test_x[p-1]",
           "1.00s call     tests/b.py::test_y", "(12 durations < 0.005s hidden.)", "2 passed in 5.0s"]
    assert durations_of_log(log) == {"tests/a.py::test_x[p-1]": 3.75, "tests/b.py::test_y": 1.0}


def _git(cwd, *args):
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, env=env)


def test_consecutive_commits_of_main_take_consecutive_slices(tmp_path):
    """A merge adds one commit to main's first-parent line, whatever the branch held; a rerun of a
    commit gets its slice again."""
    _git(tmp_path, "init", "-q", "-b", "main")
    seen = []
    for i in range(3):
        _git(tmp_path, "commit", "-q", "--allow-empty", "-m", f"c{i}")
        seen.append(commit_slice(3, str(tmp_path))[0])
    _git(tmp_path, "checkout", "-q", "-b", "topic")
    for i in range(4):
        _git(tmp_path, "commit", "-q", "--allow-empty", "-m", f"topic {i}")
    _git(tmp_path, "checkout", "-q", "main")
    _git(tmp_path, "merge", "-q", "--no-ff", "-m", "merge topic", "topic")
    seen.append(commit_slice(3, str(tmp_path))[0])
    assert seen == [2, 3, 1, 2] and commit_slice(3, str(tmp_path))[0] == 2


SLOW_FILE = '''import pytest
@pytest.mark.slow
@pytest.mark.parametrize("i", range(12))
def test_slow(i):
    pass
def test_default():
    pass
'''


def _collect(root, *args):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *args,
                          "test_probe.py"], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"))  # (installed plugins cost seconds)
    return out.returncode, [line for line in out.stdout.splitlines() if line.startswith("test_probe.py::")], out.stdout


def test_slices_through_pytest_partition_the_slow_tests(tmp_path):
    for name in ("conftest.py", "slow_rotation.py"):
        shutil.copy(os.path.join(HERE, name), tmp_path / name)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers = slow: slow\n")
    (tmp_path / "test_probe.py").write_text(SLOW_FILE)
    rc, every, _ = _collect(tmp_path, "-m", "slow")
    assert rc == 0 and len(every) == 12
    parts = []
    for k in (1, 2, 3):
        rc, ids, out = _collect(tmp_path, "-m", "slow", "--slow-slice", f"{k}/3")
        assert rc in (0, 5) and f"slow slice {k}/3: {len(ids)} tests" in out  # 5: an empty slice
        parts += ids
    assert sorted(parts) == sorted(every)  # disjoint and complete
    rc, ids, _ = _collect(tmp_path, "--slow-slice", "1/3")  # the default tests stay whatever the slice
    assert "test_probe.py::test_default" in ids
