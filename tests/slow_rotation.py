"""The slow tier's rotation: the slow tests split into SLICES slices of about equal time; each CI
run runs one slice, the one its commit names, so that every slow test runs once in every SLICES
consecutive commits of main.

A slice is chosen by the commit's place on main's first-parent line (`git rev-list --count
--first-parent HEAD`): consecutive commits there take consecutive slices, and a rerun of a
commit runs the same one. Tests with a recorded duration (slow_durations.json, written from a
`--durations=0` log by `python3 tests/slow_rotation.py --record LOG`) are balanced by it, longest
first onto the lightest slice; a test without one (a new test) goes to the slice its id's hash
names, so adding a test moves no other.

`python3 tests/slow_rotation.py` prints this commit's slice as K/N for `pytest --slow-slice K/N`.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import os
import re
import subprocess
import sys
from typing import Dict, Iterable, Optional, Tuple

SLICES = 6  # every slow test runs at least once in every SLICES consecutive CI runs
HERE = os.path.dirname(os.path.abspath(__file__))
DURATIONS = os.path.join(HERE, "slow_durations.json")


def parse_slice(spec: str) -> Tuple[int, int]:
    """(k, n) of "K/N" (1 <= K <= N), or ValueError naming the problem."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec or "")
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"--slow-slice {spec!r}: expected K/N with 1 <= K <= N, e.g. 2/{SLICES}")
    return int(m.group(1)), int(m.group(2))


def load_durations(path: str = DURATIONS) -> Dict[str, float]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {k: float(v) for k, v in json.load(f).items()}


def balance(durations: Dict[str, float], n: int) -> Dict[str, int]:
    """Test id -> slice (0-based): longest first, each onto the slice with the least time so far."""
    heap = [(0.0, i) for i in range(n)]
    out = {}
    for test_id, seconds in sorted(durations.items(), key=lambda kv: (-kv[1], kv[0])):
        load, i = heapq.heappop(heap)
        out[test_id] = i
        heapq.heappush(heap, (load + seconds, i))
    return out


def hashed_slice(test_id: str, n: int) -> int:
    return int.from_bytes(hashlib.sha256(test_id.encode()).digest()[:8], "big") % n


class Rotation:
    """Which slice each slow test belongs to, for n slices."""

    def __init__(self, n: int = SLICES, durations: Optional[Dict[str, float]] = None):
        self.n = n
        self.durations = load_durations() if durations is None else durations
        self.assigned = balance(self.durations, n)

    def slice_of(self, test_id: str) -> int:
        found = self.assigned.get(test_id)
        return hashed_slice(test_id, self.n) if found is None else found

    def seconds(self, test_ids: Iterable[str]) -> Tuple[float, int]:
        """(recorded seconds of these tests, how many have no record)."""
        ids = list(test_ids)
        return sum(self.durations.get(t, 0.0) for t in ids), sum(t not in self.durations for t in ids)


def commit_slice(n: int = SLICES, cwd: str = HERE) -> Tuple[int, str]:
    """(1-based slice of the checked-out commit, how it was chosen)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        shallow = git("rev-parse", "--is-shallow-repository") == "true"
        count = None if shallow else int(git("rev-list", "--count", "--first-parent", "HEAD"))
    except (OSError, subprocess.CalledProcessError, ValueError):
        return 1, "no git history here: slice 1"
    if count is None:  # a shallow clone has no count: the commit's hash picks (no coverage guarantee)
        return int(head[:12], 16) % n + 1, f"commit {head[:12]} (shallow clone: slice from its hash)"
    return count % n + 1, f"commit {head[:12]}, #{count} on main's first-parent line"


DURATION_LINE = re.compile(r"^\s*([0-9.]+)s\s+(?:setup|call|teardown)\s+(\S.*?)\s*$")


def durations_of_log(lines: Iterable[str]) -> Dict[str, float]:
    """Per test id, setup + call + teardown seconds from pytest's `--durations=0` report."""
    out: Dict[str, float] = {}
    for line in lines:
        m = DURATION_LINE.match(line)
        if m:
            out[m.group(2)] = round(out.get(m.group(2), 0.0) + float(m.group(1)), 2)
    return out


def record(log_path: str, path: str = DURATIONS) -> Dict[str, float]:
    """Write the durations of a `pytest -m slow --durations=0` log (kept: tests the log lacks)."""
    with open(log_path) as f:
        found = durations_of_log(f)
    merged = {**load_durations(path), **found}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(sorted(merged.items())), f, indent=0)
        f.write("\n")
    os.replace(tmp, path)
    return found


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--record"] and len(argv) == 2:
        print(f"recorded {len(record(argv[1]))} slow tests' durations in {DURATIONS}")
        return 0
    if argv:
        print("usage: slow_rotation.py [--record PYTEST_DURATIONS_LOG]", file=sys.stderr)
        return 2
    k, why = commit_slice()
    print(f"{k}/{SLICES}")
    print(f"slow slice {k}/{SLICES}: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
