"""README.md, README.zh-CN.md, docs/ and BENCHMARKS.md are the user's manual: their commands, keys, files, flags
and test names must be real.

The two guides are one guide in two languages: every check of the English one runs on the
Chinese one too, and they must cite the same commands, keys and links, section by section.
A guide stays readable: its Start fits on one screen and its contents line reaches every section.
BENCHMARKS.md is a reference: each figure's command is real, and the device call is gpu_checks.sh's own.
"""
import math
import re
import unicodedata

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import REPO
from utils.config import CLASSIC_FLAGS, Config, flatten

GUIDES = {name: (REPO / name).read_text() for name in ("README.md", "README.zh-CN.md")}
DOCS = {p.name: p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}
BENCHMARKS = (REPO / "BENCHMARKS.md").read_text()
MANUAL = {**GUIDES, **DOCS, "BENCHMARKS.md": BENCHMARKS}
TOP_LEVEL = {*GUIDES, "BENCHMARKS.md"}  # the files whose links are relative to the repository root
GPU_CHECKS = (REPO / "tools" / "gpu_checks.sh").read_text()
SCREEN = (25, 100)  # rows, columns: a terminal or an unscrolled browser window
SECTIONS = {  # the sections every guide has, in this order; one list per language, item for item
    "README.md": ("## Start", "## Which script", "## More than one machine", "## Data",
                  "## Data bigger than a disk", "## Config",
                  "## Make it yours", "## Experiments", "## What a run writes", "## Use the trained model",
                  "## What the parallelism guarantees", "## Resume", "## Bad inputs", "## Performance", "## Files"),
    "README.zh-CN.md": ("## 快速开始", "## 选哪个脚本", "## 多台机器", "## 数据", "## 数据比一块硬盘还大", "## 配置", "## 改成你自己的", "## 实验",
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


def slug(heading):
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")


def screen_rows(text):
    """Rows the text takes on a SCREEN-wide display (a CJK character is two columns wide)."""
    width = SCREEN[1]
    return sum(max(1, math.ceil(sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line) / width))
               for line in text.rstrip("\n").splitlines())


def code_spans(text):
    """Every command written in the text: inline `code` and the lines of code blocks."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)
    inline = re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))  # may wrap a line
    return [span.replace("\n", " ") for span in inline] + [line for block in blocks for line in block.splitlines()]


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


@guides
def test_each_guides_start_fits_on_one_screen(name):
    start = sections(GUIDES[name])[0]
    rows = screen_rows(start)
    assert rows <= SCREEN[0], f"{name}: the Start section takes {rows} rows of {SCREEN[1]} columns"


@guides
def test_each_guides_contents_line_reaches_every_section_in_order(name):
    top = GUIDES[name].split("\n## ", 1)[0]
    anchors = re.findall(r"\]\(#([^)]+)\)", top)
    headings = re.findall(r"^## .*", GUIDES[name], flags=re.M)
    assert anchors == [slug(h) for h in headings], "the contents above the first section"


@guides
def test_every_page_of_the_manual_is_linked_from_each_guide(name):
    pages = {f"docs/{page}" for page in DOCS} | {"BENCHMARKS.md"}
    assert pages - local_links(GUIDES[name]) == set()


def test_every_anchor_link_reaches_a_heading():
    for name, text in MANUAL.items():
        base = REPO if name in TOP_LEVEL else REPO / "docs"
        for target, anchor in re.findall(r"\]\(((?!https?:)[^)#]*)#([^)]+)\)", text):
            linked = (base / target).read_text() if target else text
            assert anchor in {slug(h) for h in re.findall(r"^#+ .*", linked, flags=re.M)}, (name, target, anchor)


def test_every_pointer_from_the_code_into_a_section_of_benchmarks_finds_it():
    """Code points into BENCHMARKS.md by a section named in quotes after it; that heading must be there."""
    headings = {h.lstrip("#").strip() for h in re.findall(r"^#+ .*", BENCHMARKS, flags=re.M)}
    files = [p for pattern in ("*.py", "*/*.py", "tools/*.sh", "requirements.txt") for p in REPO.glob(pattern)]
    for path in files:
        for section in re.findall(r'BENCHMARKS\.md,\s+(?:#\s*)?section\s+"([^"]+)"', path.read_text()):
            assert section in headings, (path.name, section)


def figures(section):
    """The figures of a BENCHMARKS.md section: (title, paragraph) for each paragraph opening in a bold title."""
    text = BENCHMARKS.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [(p.split("**")[1], p) for p in re.split(r"\n\s*\n", text) if p.startswith("**")]


def test_each_cpu_figure_gives_its_command_and_its_bound():
    """A figure without its command cannot be measured again, one without a bound cannot be judged: each
    names a command in code (`python ...`, `bash ...`, `torchrun ...`, or `...` continuing the previous one)
    and its bound ("Bound", a limit) or says it has none ("Report")."""
    found = figures("CPU figures")
    assert len(found) >= 10
    for title, para in found:
        spans = [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", para)]
        assert any(re.match(r"(\S+=\S+ )*(\.venv/bin/)?(python|bash|torchrun|\.\.\. )", s) for s in spans), title
        assert re.search(r"\b(Bound|bounds?|Report|report|limit)\b", para), title


def test_benchmarks_holds_todays_figures_not_a_dated_log():
    """One figure per row, replaced when measured again: no dates (git has them) and no design notes,
    which live in docs/ (the GPU pipeline's: docs/gpu-pipeline.md)."""
    months = "January|February|March|April|May|June|July|August|September|October|November|December"
    assert not re.findall(rf"\b(?:\d{{4}}-\d\d-\d\d|\d\d?/\d\d?/\d{{4}}|(?:{months}) \d{{4}}|\d\d? (?:{months}))\b",
                          BENCHMARKS)
    assert "\n## GPU input pipeline\n" not in BENCHMARKS and "## Why" in DOCS["gpu-pipeline.md"]


def test_the_manual_names_no_commit_or_issue_of_this_project():
    """The history is git's: no commit hash (7-40 hex digits; a weights file's hash suffix is no commit)
    and no issue number. Upstream bugs are cited as owner/repo#N."""
    for name, text in MANUAL.items():
        assert not re.findall(r"(?<![\w/-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])", text), name
        assert not re.findall(r"\bissues? \d+", text, flags=re.I), name


def test_benchmarks_device_call_is_the_one_gpu_checks_sh_documents():
    call = BENCHMARKS.split("**The device call.**", 1)[1].split("\n## ", 1)[0]
    lines = [line for block in re.findall(r"^```bash\n(.*?)^```", call, flags=re.M | re.S) for line in block.splitlines()]
    assert "WHEELS=.whl OUT=\"$OUT\" bash tools/gpu_checks.sh" in lines and any("pip download" in x for x in lines)
    header = "\n".join(line[1:].strip() for line in GPU_CHECKS.splitlines() if line.startswith("#"))
    for line in lines:
        assert line in header, line


def test_benchmarks_lists_what_every_gpu_checks_step_measures():
    known = re.search(r"^KNOWN\+=\(([^)]*)\)", GPU_CHECKS, flags=re.M).group(1).split()
    steps = set(known + re.findall(r"^\s+step (\w+) ", GPU_CHECKS, flags=re.M)) - {"setup"}  # setup installs
    unmeasured = BENCHMARKS.split("## GPU figures not yet measured", 1)[1].split("\n## ", 1)[0]
    assert len(steps) >= 5
    for step in steps:
        assert re.search(rf"^\d+\. `{step}`", unmeasured, flags=re.M), step


def test_every_flag_given_to_a_benchmark_or_tool_is_one_it_takes():
    """A flag after benchmarks/X.py or tools/X.py in any command of the manual is in that script (or is
    one of the training command line's, for the tools that read it). After a lone `--` comes the training
    command the tool runs (tools/kfold.py, tools/sweep.py): its flags are the training scripts'."""
    config_flags = (REPO / "utils" / "config.py").read_text()
    checked = 0
    for name, text in MANUAL.items():
        for span in code_spans(text):
            for script, args in re.findall(r"((?:benchmarks|tools)/\w+\.py)((?: +[^|;&#]*)?)", span):
                source = (REPO / script).read_text()
                for flag in re.findall(r"(?<!\S)(--[a-z][\w-]*)", re.split(r"(?<!\S)--(?!\S)", args)[0]):
                    assert f'"{flag}"' in source or f'"{flag}"' in config_flags, (name, script, flag)
                    checked += 1
    assert checked >= 8


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
    """Start generates the set, then trains on it: the generator's line comes before the training's."""
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    start = commands(sections(GUIDES[name])[0])
    generate = [i for i, c in enumerate(start) if c == f".venv/bin/python demo/flowers.py {demo['data']['path']}"]
    train = [i for i, c in enumerate(start) if c.startswith(".venv/bin/python train.py --config configs/demo.yaml")]
    assert generate and train and generate[0] < train[0], start


@guides
def test_the_trained_model_commands_read_the_run_the_start_command_writes(name):
    """A newcomer types Start, then predict/export/--eval-only on its run: one folder, or 'does not exist'."""
    start = "\n".join(commands(sections(GUIDES[name])[0]))
    written = re.search(r"train\.py --config configs/demo\.yaml --output-dir (\S+)$", start, flags=re.M)
    assert written, f"{name}: the Start command names its run directory (--output-dir)"
    read = re.findall(r"(?:predict|export)\.py (runs/[^\s/`]+)|--resume (runs/[^\s/`]+)/checkpoints", GUIDES[name])
    assert read and {a or b for a, b in read} == {written.group(1)}, read


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


@guides
def test_the_file_map_names_every_file_a_user_meets(name):
    """Every entry script, module, tool, benchmark, demo, SLURM file and config has its row."""
    files = sections(GUIDES[name])[-1]
    named = set(re.findall(r"`([\w./-]+)`", files))
    patterns = ("*.py", "utils/*.py", "tools/*", "benchmarks/*.py", "demo/*.py", "slurm/*", "configs/**/*.yaml")
    present = {p.relative_to(REPO).as_posix() for pattern in patterns for p in REPO.glob(pattern)
               if p.is_file() and p.name != "__init__.py"}
    assert present - named == set(), f"{name}: the file map lacks these"


def test_every_local_link_resolves():
    for name, text in MANUAL.items():
        base = REPO if name in TOP_LEVEL else REPO / "docs"
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


@guides
def test_a_guide_whose_commands_say_python_says_to_activate_the_venv_in_its_start(name):
    """Start makes .venv; a bare `python train.py` later would be the system's, without torch."""
    bare = [c for c in code_spans(GUIDES[name]) if re.match(r"(python|torchrun|tensorboard) ", c)]
    assert not bare or "source .venv/bin/activate" in sections(GUIDES[name])[0], bare[:3]
