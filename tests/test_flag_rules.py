"""Flags without their partner, values that cannot train, and outputs that cannot be written: one
`error:` line, exit 2, before any work (megatron_lite/flag_rules.py)."""
import sys
from dataclasses import fields

import pytest

from megatron_lite import flag_rules
from megatron_lite.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainingConfig
from megatron_lite.errors import ConfigError
from megatron_lite.transformer.moe.config import MoEConfig
from tests.training_utils import assert_one_line_error
from tests.test_validation import BASE

ROPE = ["--position-embedding-type", "rope"]
CASES = [  # (flags, fragment of the one line)
    (["--fp8-param-gather"], "--fp8-param-gather only means something with --fp8-format"),
    (["--q-lora-rank", "8"], "--q-lora-rank 8 only means something with --multi-latent-attention"),
    (["--mtp-loss-scaling-factor", "0.5"], "--mtp-loss-scaling-factor 0.5 only means something with --mtp-num-layers"),
    (["--rope-type", "yarn", "--position-embedding-type", "learned_absolute"],
     "yarn only means something with --position-embedding-type rope"),
    (ROPE + ["--beta-fast", "16"], "--beta-fast 16.0 only means something with --rope-type yarn"),
    (["--memory-snapshot-path", "/proc/x.pickle"], "only means something with --record-memory-history"),
    (["--cpu-offloading", "--cpu-offloading-num-layers", "0"], "--cpu-offloading-num-layers (0) must be >= 1"),
    (["--virtual-pipeline-model-parallel-size", "0"], "--virtual-pipeline-model-parallel-size (0) must be >= 1"),
    (["--optimizer", "muon", "--muon-extra-scale-factor", "0"], "--muon-extra-scale-factor (0.0) must be > 0"),
    (["--save", "", "--save-interval", "2"], "--save is empty"),
    (["--load", ""], "--load is empty"),
    (["--init-method-std", "-1"], "--init-method-std (-1.0) must be > 0"),
    (["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "inf"], "--mtp-loss-scaling-factor (inf) must be a finite"),
    (ROPE + ["--rope-type", "yarn", "--mscale", "nan"], "--mscale (nan) must be a finite number"),
    (ROPE + ["--rotary-base", "0"], "--rotary-base (0.0) must be > 0"),
    (ROPE + ["--rotary-base", "-5"], "--rotary-base (-5.0) must be > 0"),
    (["--metrics-file", "/proc/m.jsonl"], "--metrics-file /proc/m.jsonl: cannot write under /proc"),
    (["--record-memory-history", "--memory-snapshot-path", "/proc/x/s.pickle"], "cannot write under /proc"),
]


@pytest.mark.parametrize("flags,fragment", CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_flag_is_one_line(flags, fragment, monkeypatch, capsys):
    assert_one_line_error(BASE + flags, fragment, monkeypatch, capsys)


def test_metrics_file_naming_a_directory(tmp_path, monkeypatch, capsys):
    assert_one_line_error(BASE + ["--metrics-file", str(tmp_path)], "is a directory: give a file path",
                          monkeypatch, capsys)


@pytest.mark.parametrize("flags,module", [(["--tensorboard-dir", "tb"], "tensorboard"),
                                          (["--wandb-project", "p", "--wandb-exp-name", "e"], "wandb")])
def test_missing_logging_package_names_the_extra(flags, module, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)  # what an environment without the package gives
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(BASE + flags, f"needs the {module} package, which is not installed: install "
                                        f"megatron-lite[logging]", monkeypatch, capsys)


# --- the partner table itself --------------------------------------------------------------------
SECTIONS = (("model", ModelConfig), ("moe", MoEConfig), ("parallel", ParallelConfig), ("training", TrainingConfig),
            ("data", DataConfig))


def _governed():
    """(section name, field) of every field a partner rule governs."""
    for name, cls in SECTIONS:
        for f in fields(cls):
            key = f.name if f.name in flag_rules.PARTNERS else flag_rules.doc_prefix(f.metadata.get("help", ""))
            if key in flag_rules.PARTNERS:
                yield name, f, flag_rules.PARTNERS[key]


def _other_value(f):
    default = flag_rules._default(f)
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default * 2 + 1
    return "x" if "str" in str(f.type) else 1


GOVERNED = list(_governed())


@pytest.mark.parametrize("section,f,rule", GOVERNED, ids=[f.name for _, f, _ in GOVERNED])
def test_every_governed_flag_is_refused_without_its_partner(section, f, rule):
    cfg = Config()
    cfg.model.moe = MoEConfig(num_experts=4)
    owner = cfg.model.moe if section == "moe" else getattr(cfg, section)
    assert not rule.on(cfg), f"the default configuration turns on {rule.needs}"
    setattr(owner, f.name, _other_value(f))
    with pytest.raises(ConfigError, match=f"only means something with {rule.needs}".replace("|", r"\|")
                       .replace("(", r"\(").replace(")", r"\)")):
        flag_rules.check_partners(cfg)


def test_every_doc_prefix_is_classified():
    """A field documented "<feature>: ..." either needs that feature (PARTNERS) or is it
    (NOT_PARTNERS): a new prefix must be classified, so no partner goes unchecked."""
    prefixes = {flag_rules.doc_prefix(f.metadata.get("help", "")) for _, cls in SECTIONS for f in fields(cls)} - {None}
    known = set(flag_rules.PARTNERS) | flag_rules.NOT_PARTNERS | flag_rules.TOLERATED
    assert prefixes <= known, f"classify these doc prefixes in megatron_lite/flag_rules.py: {prefixes - known}"
    assert len(GOVERNED) >= 40  # the table reaches the fields (a renamed prefix would silently govern none)


def test_partner_given_is_accepted():
    cfg = Config()
    cfg.model.position_embedding_type, cfg.model.rope_scaling_type, cfg.model.mscale = "rope", "yarn", 2.0
    cfg.training.fp8_format, cfg.training.fp8_param_gather = "e4m3", True
    flag_rules.check_partners(cfg)
