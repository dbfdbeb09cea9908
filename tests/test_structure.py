"""The shape rules beside the layering ones (docs/ARCHITECTURE.md): no two files of the library, the
models or the tools import each other, directly or around a loop (imports inside functions count:
they are knowledge of each other all the same), and no module-level value of the library or the models
is changed at run time: state lives in objects that their owner builds and passes on. (A tool's pool
initializer may keep its worker process's encoder in a module-level slot: that process is the owner.)"""
import ast

from test_layering import ROOT, _files

PACKAGES = ("megatron_lite", "models", "tools")
MUTATORS = {"add", "append", "extend", "insert", "update", "setdefault", "pop", "popitem", "remove", "discard",
            "clear", "__setitem__"}
CONTAINERS = {"list", "dict", "set", "defaultdict", "OrderedDict", "deque", "Counter", "local"}


def _module_files(root=ROOT):
    files = [p for sub in PACKAGES for p in _files(sub, root)]
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p for p in files}


def _import_graph(root=ROOT):
    """module -> the modules (files of PACKAGES) it imports; `from pkg import a` means the file pkg/a.py
    where there is one, else pkg's __init__."""
    mods = _module_files(root)
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        package = m.split(".") if path.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - (node.level - 1)] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [module] + subs
            else:
                continue
            graph[m] |= {t for t in targets if t in mods and t != m}
    return graph


def _cycles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_file_imports_itself_around_a_loop():
    assert _cycles(_import_graph()) == []


def _mutable_module_values(tree):
    """Module-level names bound to a container, or to an instance of a class of the same file."""
    own_classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    names = {}
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
            kind = "container"
        elif isinstance(value, ast.Call):
            f = value.func
            called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            kind = "container" if called in CONTAINERS else "instance" if called in own_classes else None
        else:
            kind = None
        for t in targets:
            if kind and isinstance(t, ast.Name):
                names[t.id] = kind
    return names


def _changed_at_run_time(path):
    """(line, name) where a function changes (or, for an instance, uses) a mutable module-level value."""
    tree = ast.parse(path.read_text())
    names = _mutable_module_values(tree)
    found = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
        for node in ast.walk(fn):
            target = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                target = node.func.value
            elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, (ast.Store, ast.Del)):
                target = node.value
            elif isinstance(node, ast.Name) and names.get(node.id) == "instance":
                target = node
            if isinstance(target, ast.Name) and target.id in names:
                found.append((node.lineno, target.id))
    return found


def test_no_module_level_value_changes_at_run_time():
    found = [f"{p.relative_to(ROOT)}:{line} {name}" for sub in ("megatron_lite", "models") for p in _files(sub)
             for line, name in _changed_at_run_time(p)]
    assert found == [], found


def test_the_checkers_see_a_cycle_and_module_state(tmp_path):
    pkg = tmp_path / "megatron_lite" / "parallel"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from megatron_lite.parallel import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert _cycles(_import_graph(tmp_path)) == [["megatron_lite.parallel.a", "megatron_lite.parallel.b"]]
    probe = tmp_path / "probe.py"
    probe.write_text("import threading\nclass Buffers:\n    pass\n_OPEN = set()\n_ON = threading.local()\n"
                     "BUFFERS = Buffers()\nTABLE = {'a': 1}\n"
                     "def f(p):\n    _OPEN.add(p)\n    _ON.on = True\n    return BUFFERS, TABLE['a']\n")
    assert [name for _, name in _changed_at_run_time(probe)] == ["_OPEN", "_ON", "BUFFERS"]


def _tree(rel):
    return ast.parse((ROOT / rel).read_text())


def test_the_loop_branches_on_no_feature_and_builds_in_few_lines():
    """Trainer features plug in through training/features.py: no flag that build_features reads
    decides a branch of the loop, and Trainer.__init__ stays short."""
    build = next(n for n in ast.walk(_tree("megatron_lite/training/features.py"))
                 if isinstance(n, ast.FunctionDef) and n.name == "build_features")
    conditions = [n.test for n in ast.walk(build) if isinstance(n, ast.If)]  # ... and each (flag, feature)'s flag
    conditions += [n.elts[0] for n in ast.walk(build) if isinstance(n, ast.Tuple) and len(n.elts) == 2]
    flags = {a.attr for c in conditions for a in ast.walk(c) if isinstance(a, ast.Attribute)}
    loop = _tree("megatron_lite/training/loop.py")
    assert {"manual_gc", "log_straggler", "hang_detection_factor", "cpu_offloading"} <= flags
    assert flags & _branch_words(loop) == set()
    parts = {"Float8GemmPath", "HangWatchdog", "StragglerLog", "StepProfiler", "ActivationOffloader", "QKClip"}
    assert parts & {n.id for n in ast.walk(loop) if isinstance(n, ast.Name)} == set()
    init = next(n for n in ast.walk(loop) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert init.end_lineno - init.lineno + 1 < 50


def _branch_words(tree) -> set:
    """Every name and attribute in the conditions of the branches of `tree`."""
    tests = [n.test for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    return {getattr(a, "attr", getattr(a, "id", "")) for t in tests for a in ast.walk(t)}


def test_the_optimizer_and_gradient_sync_branch_on_no_offload():
    """The offload stores sit behind their interfaces (optim/state_store.py, parallel/param_offload.py):
    the optimizer and GradientSync reach them through it, never by asking whether one is there."""
    for rel in ("megatron_lite/optim/distributed_optimizer.py", "megatron_lite/parallel/data_parallel.py"):
        found = {w for w in _branch_words(_tree(rel)) if any(k in w for k in ("spill", "nvme", "offload"))}
        assert found == set(), (rel, found)
