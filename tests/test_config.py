"""The typed config: classic flags, dotted overrides, precedence, bool parsing,
one-line errors from the real script, and configs/default.yaml against the schema.

    python -m pytest tests/test_config.py -q
"""
import os
import re

import pytest
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ReadonlyConfigError

import utils.config as config
from bad_files import call_main
from conftest import REPO, run_entry
from utils.config import Config, flatten, load_config
from utils.errors import UserError

DEFAULT_YAML = REPO / "configs" / "default.yaml"


# --------------------------------------------------------------------------- classic flags

@pytest.mark.parametrize("flag, value, key, expected", [
    ("--epochs", "3", "train.epochs", 3),
    ("--batch-size", "8", "train.batch_size", 8),
    ("--lr", "0.05", "optim.lr", 0.05),
    ("--lrf", "0.2", "optim.lrf", 0.2),
    ("--syncBN", "True", "model.sync_bn", True),
    ("--weights", "resnet34-pre.pth", "model.weights", "resnet34-pre.pth"),
    ("--freeze-layers", "True", "model.freeze_layers", True),
    ("--data-path", "/data/flower_photos", "data.path", "/data/flower_photos"),
    ("--device", "cpu", "train.device", "cpu"),
    ("--output-dir", "runs/mine", "output_dir", "runs/mine"),
])
def test_classic_flag_lands_on_its_key(flag, value, key, expected):
    default = OmegaConf.select(load_config([]), key)
    assert default != expected  # otherwise the test could not tell the flag was ignored
    cfg = load_config([flag, value])
    got = OmegaConf.select(cfg, key)
    assert got == expected and type(got) is type(expected)


def test_dotted_overrides_set_nested_keys():
    cfg = load_config(["optim.lr=0.003", "data.img_size=64", "model.name=resnet18",
                       "train.amp=off", "optim.warmup_epochs=0.5", "data.pin_memory=false"])
    assert cfg.optim.lr == 0.003
    assert cfg.data.img_size == 64
    assert cfg.model.name == "resnet18"
    assert cfg.train.amp == "off"
    assert cfg.optim.warmup_epochs == 0.5
    assert cfg.data.pin_memory is False


@pytest.mark.parametrize("text, expected", [
    ("True", True), ("False", False), ("true", True), ("false", False), ("1", True), ("0", False),
])
@pytest.mark.parametrize("flag, key", [("--syncBN", "model.sync_bn"), ("--freeze-layers", "model.freeze_layers")])
def test_bool_flags_parse_every_spelling(tmp_path, flag, key, text, expected):
    # A recipe holding the opposite value, so a flag that is ignored cannot pass.
    section, name = key.split(".")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({section: {name: not expected}}))
    cfg = load_config(["--config", str(recipe), flag, text])
    assert OmegaConf.select(cfg, key) is expected


def test_bool_dotted_override_false_really_is_false():
    # The classic scripts' bug: argparse type=bool turns the string "False" into True.
    assert load_config(["model.sync_bn=False"]).model.sync_bn is False
    assert load_config(["--syncBN", "True", "model.sync_bn=False"]).model.sync_bn is False


# --------------------------------------------------------------------------- precedence

def test_precedence_default_yaml_then_file_then_flags_then_dotted(tmp_path, monkeypatch):
    """default.yaml < --config FILE < classic flags < dotted overrides, each layer visible."""
    # A private default.yaml, so the default.yaml step is visible too.
    default = yaml.safe_load(DEFAULT_YAML.read_text())
    default["optim"]["momentum"] = 0.5
    default["train"]["seed"] = 11
    default["train"]["batch_size"] = 2
    default_path = tmp_path / "default.yaml"
    default_path.write_text(yaml.safe_dump(default))
    monkeypatch.setattr(config, "DEFAULT_CONFIG", default_path)

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train:\n  seed: 12\n  batch_size: 3\n  epochs: 4\noptim:\n  lr: 0.4\n")

    cfg = load_config(["--config", str(recipe), "--batch-size", "5", "--epochs", "6",
                       "train.epochs=7"])
    assert cfg.optim.weight_decay == default["optim"]["weight_decay"]  # nobody set it: default.yaml
    assert cfg.optim.momentum == 0.5     # default.yaml's value
    assert cfg.train.seed == 12          # --config over default.yaml
    assert cfg.optim.lr == 0.4           # --config over default.yaml
    assert cfg.train.batch_size == 5     # flag over --config
    assert cfg.train.epochs == 7         # dotted over flag over --config

    # Dotted wins whatever the order on the command line.
    cfg = load_config(["train.epochs=7", "--epochs", "6"])
    assert cfg.train.epochs == 7


def test_amp_off_survives_yaml_reading_off_as_false(tmp_path):
    # YAML 1.1 turns a bare `off` into the bool false; the documented value must still work.
    assert load_config(["train.amp=off"]).train.amp == "off"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train:\n  amp: off\n")
    assert load_config(["--config", str(recipe)]).train.amp == "off"


def test_config_is_read_only():
    cfg = load_config([])
    # The read-only refusal itself, not any error: a misspelt key (cfg.train.epochz) raises another.
    with pytest.raises(ReadonlyConfigError, match="Cannot change read-only config container") as e:
        cfg.train.epochs = 3
    assert e.value.full_key == "train.epochs"
    assert cfg.train.epochs == load_config([]).train.epochs


# --------------------------------------------------------------------------- errors, in process

@pytest.mark.parametrize("argv, key", [
    (["--lr", "fast"], "optim.lr"),
    (["--syncBN", "maybe"], "model.sync_bn"),
    (["data.img_size=big"], "data.img_size"),
    (["model.nmae=resnet18"], "model.nmae"),
    (["optim.lrr=1"], "optim.lrr"),
])
def test_bad_value_or_key_names_the_key(argv, key):
    with pytest.raises(UserError) as e:
        load_config(argv)
    assert f"'{key}'" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv, guess", [(["optim.lrr=1"], "optim.lr"), (["trian.epochs=3"], "train")])
def test_an_unknown_key_or_section_gets_the_nearest_name(argv, guess):
    with pytest.raises(UserError, match=f"did you mean '{guess}'"):
        load_config(argv)


# --------------------------------------------------------------------------- errors, real script

@pytest.fixture(scope="module")
def bad_cli_runs(tmp_path_factory):
    """train.py's main() with `--epochs abc` and with `optim.lrr=1`, in this process from an empty cwd:
    the exit code, the lines and what is left in the cwd are the point, not the process."""
    import train
    cwd = tmp_path_factory.mktemp("bad_cli")
    cases = {"bad_type": ["--epochs", "abc"], "unknown_key": ["optim.lrr=1"]}
    out, before = {}, os.getcwd()
    os.chdir(cwd)
    try:
        for name, argv in cases.items():
            out[name] = call_main(train.main, argv)
    finally:
        os.chdir(before)
    out["cwd_after"] = sorted(x.name for x in cwd.iterdir())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case, key, extra", [
    ("bad_type", "train.epochs", "abc"),
    ("unknown_key", "optim.lrr", "did you mean 'optim.lr'"),
])
def test_script_stops_with_one_line_naming_the_key(bad_cli_runs, case, key, extra):
    rc, stdout, stderr = bad_cli_runs[case]
    assert rc != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error:") and f"'{key}'" in lines[0] and extra in lines[0]
    assert stdout == ""
    assert bad_cli_runs["cwd_after"] == []  # stopped before any run directory or data


# --------------------------------------------------------------------------- default.yaml vs schema

def _leaf_lines(text):
    """(dotted key, line) for every `key: value` line of a two-level YAML file."""
    section = None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.match(r"^(\s*)([A-Za-z_]\w*):\s*(.*)$", line)
        assert m, f"unexpected line in default.yaml: {line!r}"
        indent, key, rest = m.groups()
        if not indent and (rest == "" or rest.startswith("#")):
            section = key
            continue
        yield (f"{section}.{key}" if indent else key), line


def test_every_default_yaml_key_has_a_comment():
    leaves = list(_leaf_lines(DEFAULT_YAML.read_text()))
    assert len(leaves) == len(flatten(OmegaConf.to_container(OmegaConf.structured(Config))))
    for key, line in leaves:
        comment = line.split("#", 1)[1].strip() if "#" in line else ""
        assert len(comment) >= 10, f"{key} has no explanatory comment in default.yaml: {line!r}"


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "configs").glob("*.yaml") if p.name != "default.yaml"))
def test_each_shipped_recipe_states_only_what_differs_each_key_commented(recipe):
    path = REPO / "configs" / recipe
    defaults = flatten(yaml.safe_load(DEFAULT_YAML.read_text()))
    leaves = list(_leaf_lines(path.read_text()))
    assert leaves
    for key, line in leaves:
        assert key in defaults, f"{recipe}: '{key}' is no config key"
        assert len(line.split("#", 1)[1].strip() if "#" in line else "") >= 10, f"{recipe}: {key} has no comment"
    for key, value in flatten(yaml.safe_load(path.read_text())).items():
        assert value != defaults[key], f"{recipe}: {key}={value!r} is the default; leave it out"
    # It loads (weights are not looked up: the pretrained check has its own tests in test_model.py).
    load_config(["--config", str(path), "model.pretrained=null"])


def test_each_default_stands_in_default_yaml_alone():
    """The schema holds types only; every value comes from default.yaml, which has every key."""
    in_yaml = flatten(yaml.safe_load(DEFAULT_YAML.read_text()))
    in_schema = flatten(OmegaConf.to_container(OmegaConf.structured(Config)))
    assert sorted(in_yaml) == sorted(in_schema)
    assert set(in_schema.values()) == {"???"}, "a default value in utils/config.py: put it in default.yaml"
    assert flatten(OmegaConf.to_container(load_config([]))) == in_yaml


def test_a_key_without_a_default_is_named(tmp_path, monkeypatch):
    default = yaml.safe_load(DEFAULT_YAML.read_text())
    del default["optim"]["momentum"]
    path = tmp_path / "default.yaml"
    path.write_text(yaml.safe_dump(default))
    monkeypatch.setattr(config, "DEFAULT_CONFIG", path)
    with pytest.raises(UserError, match="config key 'optim.momentum' has no value"):
        load_config([])


@pytest.mark.slow
def test_a_config_error_under_torchrun_is_printed_once(tmp_path):
    # Every rank parses the same command line; the error is the same everywhere, so rank 0 alone says it.
    r = run_entry("train_multi_gpu_ddp.py", "--device", "cpu", "--epochs", "abc", nproc=2, cwd=tmp_path)
    assert r.returncode != 0
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]
    assert errors == ["error: bad value for 'train.epochs' (set by --epochs abc): Value 'abc' of type 'str' "
                      "could not be converted to Integer"], errors


def test_a_bad_flag_value_names_the_flag_as_typed():
    with pytest.raises(UserError) as e:
        load_config(["--syncBN", "maybe"])
    assert str(e.value).startswith("bad value for 'model.sync_bn' (set by --syncBN maybe): ")
    with pytest.raises(UserError) as e:  # a dotted override is already named by its key
        load_config(["model.sync_bn=maybe"])
    assert str(e.value).startswith("bad value for 'model.sync_bn': ")


@pytest.mark.parametrize("path", sorted((REPO / "configs").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_reads_as_pyyamls_safe_loader_reads_it(path):
    """Config files are parsed by libyaml's loader where PyYAML has it (a tenth of the start-up cost):
    each shipped file gives what yaml.safe_load gives, key for key and type for type."""
    mine, reference = config._load_yaml(path), yaml.safe_load(path.read_text())
    assert mine == reference and repr(mine) == repr(reference)
