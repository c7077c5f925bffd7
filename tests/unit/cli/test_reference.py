"""The generated references (cli/reference.py) hold a described row for every run-config field and every CLI argument, and report any entry that lacks its description.

The fields and arguments are enumerated here independently of the generator (walking the
models and the parser afresh), and looked up in the real generated Markdown, so a section the
generator skipped fails as surely as a missing description.
"""

from __future__ import annotations

import argparse
import re

from pydantic import BaseModel, Field

from eyas.cli import reference
from eyas.cli.main import build_parser
from eyas.state.executiontables import StageConfig
from eyas.state.runconfig import RunConfig
from eyas.state.specs import STAGES, NoOptions, Table


def _rows(markdown: str) -> dict[str, dict[str, list[str]]]:
    """{section heading: {key: the row's cells}} of a generated page."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for line in markdown.splitlines():
        if line.startswith("## "):
            section = line[3:]
            out[section] = {}
        elif line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            out[section][cells[0].strip("`")] = cells
    return out


def _config_keys() -> dict[str, str]:
    """Every key a run's TOML may hold, with its description, from the models themselves."""
    keys: dict[str, str] = {}

    def table(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            keys[f"{prefix}{name}"] = info.description or ""

    for name, info in RunConfig.model_fields.items():
        model = next((t for t in (info.annotation, *getattr(info.annotation, "__args__", ())) if _is_table(t)), None)
        if name == "stages":
            table(StageConfig, "stages.<name>.")
        elif model is not None:
            table(model, f"{name}.")
        else:
            keys[name] = info.description or ""
    for spec in STAGES.values():
        if spec.options is not NoOptions:
            table(spec.options, f"stages.{spec.name}.options.")
    return keys


def _is_table(t) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def test_every_config_field_has_a_described_row():
    keys = _config_keys()
    assert len(keys) > 80  # every table was walked: RunConfig's, [stages.<name>] and five options models
    rows = {k: cells for section in _rows(reference.config_markdown()).values() for k, cells in section.items()}
    for key, description in keys.items():
        assert description, f"{key} has no Field(description=...)"
        assert key in rows, f"{key} is missing from the generated config reference"
        assert rows[key][-1] != reference.UNDOCUMENTED, key
        assert rows[key][-1] == reference.md(description), key
    assert "preflight" in rows  # the top-level key RunConfig keeps no field for


def test_each_row_states_type_and_default_from_the_declaration():
    rows = {k: cells for section in _rows(reference.config_markdown()).values() for k, cells in section.items()}
    assert rows["data.max_length"][1:3] == ["integer, ≥ 16, ≤ 1048576", "`2048`"]
    assert rows["target.path"][2] == "required"
    assert rows["evaluate.tensor_parallel_size"][2] == "unset"
    assert rows["extract.backend"][1] == 'one of `"hf"`, `"vllm"`'
    assert rows["pipeline"][2] == '`["prepare", "extract", "vocab", "train", "evaluate"]`'
    assert rows["storage.budget_fraction"][1] == "number, &gt; 0, ≤ 1"


def _commands(parser: argparse.ArgumentParser):
    """(prog, subcommand help, [argument actions]) for the parser and every subcommand below it."""
    found = []

    def walk(p: argparse.ArgumentParser, text: str) -> None:
        actions = [a for a in p._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        found.append((p.prog, text, actions))
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                helps = {c.dest: c.help for c in a._choices_actions}
                for name, sub in a.choices.items():
                    walk(sub, helps.get(name) or "")

    walk(parser, parser.description or "")
    return found


def test_every_cli_command_and_argument_has_a_described_row():
    page = reference.cli_markdown()
    sections = _rows(page)
    commands = _commands(build_parser())
    assert {prog for prog, _, _ in commands} >= {"eyas", "eyas daemon start", "eyas logs", "eyas tui", "eyas init"}
    for prog, text, actions in commands:
        assert text, f"{prog} has no help"
        assert prog in sections, f"{prog} is missing from the generated CLI reference"
        assert reference.md(text) in page
        for action in actions:
            key = ", ".join(action.option_strings) or action.metavar or action.dest
            assert action.help, f"{prog} {key} has no help"
            assert key in sections[prog], f"{prog} {key} is missing from the generated CLI reference"
            assert sections[prog][key][-1] == reference.md(action.help), (prog, key)


def test_nothing_is_undocumented_today():
    assert reference.missing() == []


def test_an_undocumented_field_is_reported_and_marked():
    class Half(Table):
        """[half]: a table with one described field and one bare one."""

        described: int = Field(1, description="a field with its meaning")
        bare: int = 2

    class Bare(Table):
        pass

    sections = [reference.table_section(Half, "half.", "`[half]`"), reference.table_section(Bare, "bare.", "`[bare]`")]
    assert reference.undocumented(sections) == ["`[half]`: half.bare", "`[bare]`"]
    rows = _rows(reference.config_markdown(sections))
    assert rows["`[half]`"]["half.bare"][-1] == reference.UNDOCUMENTED
    assert rows["`[half]`"]["half.described"][-1] == "a field with its meaning"


def test_an_argument_without_help_is_reported_and_marked():
    parser = argparse.ArgumentParser(prog="tool", description="a tool")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run it")
    run.add_argument("--fast", action="store_true", help="go fast")
    run.add_argument("--bare")
    sub.add_parser("quiet")  # a subcommand without help
    sections = reference.cli_sections(parser)
    assert reference.undocumented(sections) == ["tool run: --bare", "tool quiet"]
    rows = _rows(reference.cli_markdown(sections))
    assert rows["tool run"]["--bare"][-1] == reference.UNDOCUMENTED
    assert rows["tool run"]["--fast"][1:] == ["switch", "", "go fast"]


def test_markdown_escaping_keeps_code_spans():
    assert reference.md("[train]: <id> and `<id>`, a|b") == "\\[train\\]: &lt;id&gt; and `<id>`, a\\|b"
