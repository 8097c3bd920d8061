"""The front door and the pages behind it: the README stays short and keeps its two commands,
every page it sends the reader to exists, and the configuration page names every field of the
config and every flag of the command line, so neither can drift from the code unnoticed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from elastic.cli import build_parser
from elastic.setup.config import TrainConfig

REPO = Path(__file__).parent.parent
README = (REPO / "README.md").read_text()
CONFIGURATION = (REPO / "docs" / "configuration.md").read_text()
# The set-up on a fresh machine: one command runs the main job, one passes the tests.
TWO_COMMANDS = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && elastic train",
    'pip install -e ".[dev]" && python -m pytest -q',
)


def test_the_readme_is_a_front_door_of_at_most_250_lines_with_the_two_commands():
    assert len(README.splitlines()) <= 250
    block = README.split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split("  #")[0].strip() for line in block.strip().splitlines()] == list(TWO_COMMANDS)


def test_every_page_the_readme_and_the_pages_link_to_exists():
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which is not there"


def documented_fields() -> dict[str, set[str]]:
    """The fields the configuration page's table lists, by section ('' for the top level)."""
    listed: dict[str, set[str]] = {}
    for row in re.findall(r"^\|\s*(.*?)\s*\|\s*(.*?)\s*\|", CONFIGURATION, flags=re.MULTILINE):
        section, fields = row[0].strip("` "), row[1]
        listed.setdefault(section, set()).update(re.findall(r"`(\w+)`", fields))
    return listed


def config_fields() -> list[tuple[str, str]]:
    fields = []
    for name, field in TrainConfig.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            fields += [(name, sub) for sub in field.annotation.model_fields]
        else:
            fields.append(("", name))
    return fields


def test_the_configuration_page_names_every_field_of_the_config():
    listed = documented_fields()
    missing = [f"{section}.{name}".lstrip(".") for section, name in config_fields()
               if name not in listed.get(section, ())]
    assert not missing, f"docs/configuration.md lacks {missing}: add a row to its config reference"


@pytest.mark.parametrize("command", ["train", "prepare", "report", "export"])
def test_the_configuration_page_names_every_flag_of_the_command_line(command):
    parser = build_parser()
    (subcommands,) = [action for action in parser._actions if action.choices and command in action.choices]
    flags = {flag for action in subcommands.choices[command]._actions for flag in action.option_strings
             if flag.startswith("--") and flag != "--help"}
    synopsis = CONFIGURATION.split("## CLI", 1)[1].split("```", 2)[1]
    # --[no-]compile stands for --compile and --no-compile
    spelled = set(re.findall(r"--[\w-]+", synopsis.replace("--[no-]", "--no-"))) | set(
        re.findall(r"--[\w-]+", synopsis.replace("--[no-]", "--")))
    assert flags <= spelled, f"docs/configuration.md's CLI synopsis lacks {sorted(flags - spelled)}"
