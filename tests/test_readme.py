"""README.md and docs/ are the user's manual: their commands, keys, files, flags and test names must be real."""
import re

import yaml
from omegaconf import OmegaConf

from conftest import REPO
from utils.config import CLASSIC_FLAGS, Config, flatten

README = (REPO / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}
MANUAL = {"README.md": README, **DOCS}


KEYS = set(flatten(OmegaConf.to_container(OmegaConf.structured(Config))))


def test_readme_is_a_guide_of_at_most_12_kb():
    assert len(README.encode()) <= 12 * 1024
    for section in ("## Start", "## Which script", "## Data", "## Config", "## Make it yours",
                    "## What a run writes", "## What the parallelism guarantees", "## Resume", "## Bad inputs",
                    "## Performance", "## Files"):
        assert section in README, section


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert "pip install -r requirements.txt && .venv/bin/python -m pytest -q" in README
    assert ".venv/bin/pip install -q -r requirements.txt" in ci and ".venv/bin/python -m pytest -q" in ci


def test_readme_demo_command_generates_the_demo_set_the_demo_config_reads():
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    assert (f".venv/bin/python demo/flowers.py {demo['data']['path']} && "
            ".venv/bin/python train.py --config configs/demo.yaml") in README


def test_every_config_key_named_in_the_manual_exists():
    for name, text in MANUAL.items():
        named = {k for k in re.findall(r"`((?:data|model|optim|train|ddp)\.[a-z_]+)", text) if k[-3:] != ".py"}
        assert named - KEYS - {"optim.lrr"} == set(), f"{name} names keys the schema does not have"  # lrr: the typo example


def test_every_classic_flag_listed_is_a_real_flag():
    listed = re.search(r"the classic flags: `([^`]+)`", README).group(1).split()
    assert sorted(listed) == sorted(CLASSIC_FLAGS)


def test_every_file_in_the_file_map_exists():
    table = README[README.index("| file | what it holds |"):]
    paths = re.findall(r"`([\w./-]+)`", "\n".join(line.split("|")[1] for line in table.splitlines()[2:]
                                                 if line.startswith("|")))
    assert len(paths) >= 15
    for path in paths:
        assert (REPO / path).exists(), path


def test_every_local_link_resolves():
    for name, text in MANUAL.items():
        base = REPO if name == "README.md" else REPO / "docs"
        for target in re.findall(r"\]\(((?!https?:)[^)#]+)\)", text):
            assert (base / target).exists(), f"{name} links to {target}"


def test_every_test_the_manual_cites_exists():
    defined = set()
    for path in (REPO / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", path.read_text(), flags=re.M))
    cited = set()
    for text in MANUAL.values():
        cited |= set(re.findall(r"`(test_\w+)`", text))
    assert cited, "the manual cites no test"
    assert cited - defined == set(), "cited tests that do not exist"
