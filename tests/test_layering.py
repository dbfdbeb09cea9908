"""The dependency rules of docs/ARCHITECTURE.md ("Layers"), read from the imports (function-level ones included):
megatron_lite/ never imports models/, tools/ or the entry point; megatron_lite/parallel/ imports
nothing from config, transformer, training or models (its primitives take explicit arguments);
megatron_lite/kernels/ (what both parallel/ and transformer/ compute with) imports neither; and nothing in
the library, the models or the tools keeps hidden state through `global` statements."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path, root: pathlib.Path = ROOT):
    """(line, absolute module name) of every import in a file."""
    tree = ast.parse(path.read_text())
    package = list(path.relative_to(root).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield node.lineno, module
            if not node.module:  # from . import x: x may be a module
                for alias in node.names:
                    yield node.lineno, f"{module}.{alias.name}"


def _files(sub, root=ROOT):
    return sorted((root / sub).rglob("*.py"))


def _violations(sub, forbidden, root=ROOT):
    return [f"{p.relative_to(root)}:{line} imports {m}" for p in _files(sub, root) for line, m in _imports(p, root)
            if any(m == f or m.startswith(f + ".") for f in forbidden)]


def test_library_never_imports_models_tools_or_the_entry_point():
    assert _violations("megatron_lite", ("models", "tools", "pretrain_gpt")) == []


def test_parallel_imports_no_config_training_or_models():
    assert _violations("megatron_lite/parallel", ("megatron_lite.config", "megatron_lite.training", "models")) == []


def test_parallel_imports_no_transformer_and_kernels_import_neither():
    assert _violations("megatron_lite/parallel", ("megatron_lite.transformer",)) == []
    assert _violations("megatron_lite/kernels", ("megatron_lite.parallel", "megatron_lite.transformer",
                                                 "megatron_lite.config", "megatron_lite.training", "models")) == []


def test_training_knows_no_model_part():
    """The trainer reaches MoE (and any later part with per-step work) only through the model's hooks."""
    assert _violations("megatron_lite/training", ("megatron_lite.transformer.moe",)) == []


@pytest.mark.parametrize("sub", ["megatron_lite", "models", "tools"])
def test_no_global_statements(sub):
    found = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in _files(sub) for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Global)]
    assert found == []


def test_the_checker_sees_violations(tmp_path):
    probe = tmp_path / "megatron_lite" / "parallel" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("def f():\n    from ..config import ModelConfig\n    from models.gpt import GPTModel\n"
                     "from ..transformer.attention import SelfAttention\n")
    found = _violations("megatron_lite/parallel", ("megatron_lite.config", "models", "megatron_lite.transformer"),
                        tmp_path)
    assert any("megatron_lite.config" in v for v in found) and any("models.gpt" in v for v in found), found
    assert any("megatron_lite.transformer.attention" in v for v in found), found
