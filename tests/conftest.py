import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser):
    parser.addoption("--slow-slice", metavar="K/N", default=None,
                     help="of the slow tests, run only slice K of N (CI's rotation, tests/slow_rotation.py); "
                          "`python3 tests/slow_rotation.py` prints this commit's")


def pytest_configure(config):
    spec = config.getoption("--slow-slice")
    if spec:
        from slow_rotation import parse_slice
        try:
            parse_slice(spec)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None


def pytest_collection_modifyitems(config, items):
    """--slow-slice K/N: deselect the slow tests of the other slices (the rest stay as they are)."""
    spec = config.getoption("--slow-slice")
    if not spec:
        return
    from slow_rotation import Rotation, parse_slice
    k, n = parse_slice(spec)
    rotation = Rotation(n)
    drop = [i for i in items if i.get_closest_marker("slow") and rotation.slice_of(i.nodeid) != k - 1]
    if drop:
        config.hook.pytest_deselected(items=drop)
        dropped = set(map(id, drop))
        items[:] = [i for i in items if id(i) not in dropped]
    if not hasattr(config, "workerinput"):  # an xdist worker leaves the listing to the controller
        _list_slice(config, k, n, [i.nodeid for i in items if i.get_closest_marker("slow")], rotation)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Under xdist the controller collects nothing itself: list the slice from the first worker's ids."""
    config = node.config
    spec = config.getoption("--slow-slice")
    if spec and not config.stash.get(_SLICE_LISTED, False):
        config.stash[_SLICE_LISTED] = True
        from slow_rotation import Rotation, parse_slice
        k, n = parse_slice(spec)
        rotation = Rotation(n)
        _list_slice(config, k, n, [i for i in ids if rotation.slice_of(i) == k - 1], rotation)


_SLICE_LISTED = pytest.StashKey[bool]()


def _list_slice(config, k, n, chosen, rotation):
    seconds, unknown = rotation.seconds(chosen)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    reporter.write_line(f"slow slice {k}/{n}: {len(chosen)} tests, {seconds:.0f} s recorded"
                        + (f" + {unknown} without a record" if unknown else ""))
    for test_id in chosen:
        reporter.write_line(f"  {test_id}")
