"""README.md, README.zh-CN.md and docs/ are the user's manual: their commands, keys, files, flags and test names must be real.

The two guides are one guide in two languages: every check of the English one runs on the
Chinese one too, and they must cite the same commands, keys and links, section by section.
"""
import re

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import REPO
from utils.config import CLASSIC_FLAGS, Config, flatten

README = (REPO / "README.md").read_text()
GUIDES = {name: (REPO / name).read_text() for name in ("README.md", "README.zh-CN.md")}
DOCS = {p.name: p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}
MANUAL = {**GUIDES, **DOCS}
SECTIONS = {  # the sections every guide has, in this order; one list per language, item for item
    "README.md": ("## Start", "## Which script", "## More than one machine", "## Data", "## Config",
                  "## Make it yours", "## What a run writes", "## Use the trained model",
                  "## What the parallelism guarantees", "## Resume", "## Bad inputs", "## Performance", "## Files"),
    "README.zh-CN.md": ("## 快速开始", "## 选哪个脚本", "## 多台机器", "## 数据", "## 配置", "## 改成你自己的",
                        "## 一次训练写出什么", "## 使用训练好的模型", "## 并行的保证", "## 断点续训", "## 错误输入",
                        "## 性能", "## 文件"),
}
guides = pytest.mark.parametrize("name", GUIDES)


KEYS = set(flatten(OmegaConf.to_container(OmegaConf.structured(Config))))


def keys_named(text):
    return {k for k in re.findall(r"`((?:data|model|optim|train|ddp)\.[a-z_]+)", text) if k[-3:] != ".py"}


def local_links(text):
    return set(re.findall(r"\]\(((?!https?:)[^)#]+)\)", text))


def sections(text):
    """The guide's `## ` sections, in order, each without its heading line."""
    return [part.split("\n", 1)[1] for part in re.split(r"^(?=## )", text, flags=re.M)[1:]]


def commands(section):
    """The code-block lines of a section, comments and indentation dropped: what a user types or sees."""
    lines, inside = [], False
    for line in section.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                lines.append(line)
    return lines


def test_readme_is_a_guide_of_at_most_12_kb():
    assert len(README.encode()) <= 12 * 1024


@guides
def test_each_guide_has_its_sections_in_order(name):
    headings = re.findall(r"^## .*", GUIDES[name], flags=re.M)
    assert len(headings) == len(SECTIONS[name]), headings
    for heading, section in zip(headings, SECTIONS[name]):
        assert heading.startswith(section), (heading, section)


@guides
def test_ci_runs_the_readme_test_command(name):
    ci = (REPO / ".ci" / "run").read_text()
    command = re.search(r"pip install -r requirements.txt && (\.venv/bin/python -m pytest[^\n`]*)", GUIDES[name])
    assert command, "the guide's test command"
    assert ".venv/bin/pip install -q -r requirements.txt" in ci and command.group(1) + "\n" in ci, command.group(1)


@guides
def test_readme_demo_command_generates_the_demo_set_the_demo_config_reads(name):
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    assert (f".venv/bin/python demo/flowers.py {demo['data']['path']} && "
            ".venv/bin/python train.py --config configs/demo.yaml") in GUIDES[name]


def test_every_config_key_named_in_the_manual_exists():
    for name, text in MANUAL.items():
        named = keys_named(text)
        assert named - KEYS - {"optim.lrr"} == set(), f"{name} names keys the schema does not have"  # lrr: the typo example


@guides
def test_every_classic_flag_listed_is_a_real_flag(name):
    # item 3 of the config's order of precedence, in either language
    listed = re.search(r"^3\. [^`\n]*`(--[^`]+)`", GUIDES[name], flags=re.M).group(1).split()
    assert sorted(listed) == sorted(CLASSIC_FLAGS)


@guides
def test_every_file_in_the_file_map_exists(name):
    files = sections(GUIDES[name])[-1]  # the last section is the file map
    table = files[files.index("\n|") + 1:]
    paths = re.findall(r"`([\w./-]+)`", "\n".join(line.split("|")[1] for line in table.splitlines()[2:]
                                                 if line.startswith("|")))
    assert len(paths) >= 15
    for path in paths:
        assert (REPO / path).exists(), path


def test_every_local_link_resolves():
    for name, text in MANUAL.items():
        base = REPO if name in GUIDES else REPO / "docs"
        for target in local_links(text):
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


def test_each_guide_links_the_other_at_the_top():
    assert "[中文说明](README.zh-CN.md)" in "\n".join(GUIDES["README.md"].splitlines()[:4])
    assert "[English](README.md)" in "\n".join(GUIDES["README.zh-CN.md"].splitlines()[:4])


def test_the_two_guides_give_the_same_commands_section_by_section():
    """A command, path or output line changed in one guide must change in the other, in the same section."""
    english, chinese = sections(GUIDES["README.md"]), sections(GUIDES["README.zh-CN.md"])
    assert len(english) == len(chinese)
    for heading, en, zh in zip(SECTIONS["README.md"], english, chinese):
        assert commands(en) == commands(zh), heading
    assert sum(len(commands(s)) for s in english) >= 15


def test_the_two_guides_cite_the_same_keys_and_links_section_by_section():
    english, chinese = sections(GUIDES["README.md"]), sections(GUIDES["README.zh-CN.md"])
    for heading, en, zh in zip(SECTIONS["README.md"], english, chinese):
        assert keys_named(en) == keys_named(zh), heading
        assert set(re.findall(r"\]\(([^)]+)\)", en)) == set(re.findall(r"\]\(([^)]+)\)", zh)), heading
    # above the first section: the title, the cross-link (tested above) and the web links
    en_top, zh_top = (GUIDES[name].split("\n## ", 1)[0] for name in ("README.md", "README.zh-CN.md"))
    assert set(re.findall(r"\]\((https?:[^)]+)\)", en_top)) == set(re.findall(r"\]\((https?:[^)]+)\)", zh_top))
