"""The README is the user's manual: its key table and commands must match the code."""
import re

from omegaconf import OmegaConf

from conftest import REPO
from utils.config import Config

README = (REPO / "README.md").read_text()


def _schema_keys(node, prefix=""):
    for key, value in node.items():
        if OmegaConf.is_dict(value):
            yield from _schema_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_every_config_key_is_in_the_readme_table():
    start = README.index("| key | default | meaning |")
    table_text = README[start:README.index("\n\n", start)]
    table = set(re.findall(r"^\| `([a-z_.]+)` \|", table_text, flags=re.M))
    keys = set(_schema_keys(OmegaConf.structured(Config)))
    assert keys - table == set(), "keys missing from the README's config table"
    assert table - keys == set(), "README lists keys the schema does not have"


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert "pip install -r requirements.txt && .venv/bin/python -m pytest -q" in README
    assert ".venv/bin/pip install -q -r requirements.txt" in ci and ".venv/bin/python -m pytest -q" in ci


def test_readme_demo_command_is_the_demo_config():
    assert ".venv/bin/python train.py --config configs/demo.yaml" in README
    assert (REPO / "configs" / "demo.yaml").is_file()
