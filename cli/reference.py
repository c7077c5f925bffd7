"""The generated references of the docs site: every run-config key and every CLI argument as Markdown, read from the code, with the entries that lack a description named.

The run config's reference walks the pydantic models (`RunConfig` in state/runconfig.py, the
tables it holds from state/inputtables.py, drafttables.py, executiontables.py and the others,
`[stages.<name>]` and each stage's options model in state/specs.py) and takes each field's type,
bounds and default from its declaration and its meaning from `Field(description=...)`; a table's
introduction is its model's docstring. The CLI's walks the
argparse parser `eyas.cli.main.build_parser()` returns: every command, subcommand, flag and
positional with its help. Since the pages are built from the code at each `mkdocs build` (the
hook docs/hooks/reference.py calls `pages()`), they cannot drift from it; what they cannot say is
a meaning nobody wrote, so an entry without one is marked undocumented in the page and listed by
`missing()`, which fails the strict build and tests/unit/cli/test_reference.py.
"""

from __future__ import annotations

import argparse
import json
import re
import types
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo

# What a row without a description shows; undocumented() finds the same rows.
UNDOCUMENTED = "**undocumented**"
CONFIG_PAGE = "reference/config.md"
CLI_PAGE = "reference/cli.md"

# A top-level key that RunConfig holds no field for: validate() reads it and puts the preflight
# stage into the pipeline (runconfig._with_preflight), so its row is written here.
PREFLIGHT_KEY = (
    "preflight",
    "boolean",
    "`true`",
    "Run `eyas doctor`'s checks (and the engines' canaries) as a first `preflight` stage when a stage reads "
    "the target; `false`: no preflight. Listing `preflight` in `pipeline` places it yourself.",
)


@dataclass(frozen=True)
class Entry:
    """One row: a config key or a CLI argument."""

    key: str  # `train.lr`; `--rank`
    kind: str  # the type and bounds, or the argument's metavar
    default: str  # already Markdown: `3`, unset, required
    text: str  # the description or help; "" when nobody wrote one


@dataclass
class Section:
    """One heading of a page: a TOML table, or an `eyas` command."""

    title: str
    intro: str  # the model's docstring, or the command's help; "" when missing
    entries: list[Entry] = field(default_factory=list)
    usage: str = ""  # a command's usage line


# --- Markdown ----------------------------------------------------------------------------------

# Backslash-escaped: Python-Markdown unescapes these (and `|` in tables); `<` it does not, so
# the angle brackets become entities.
_SPECIAL = re.compile(r"([\\\[\]|*_])")
_ENTITIES = {"<": "&lt;", ">": "&gt;"}


def md(text: str) -> str:
    """`text` safe in a Markdown table cell and paragraph: outside code spans, the characters that
    would start a link, an HTML tag, emphasis or a new cell are escaped (a docstring's `[train]:`
    would otherwise read as a link definition, and `<id>` as a tag); code spans stay as written."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even pieces lie outside backticks
        escaped = _SPECIAL.sub(r"\\\1", parts[i])
        parts[i] = re.sub("[<>]", lambda m: _ENTITIES[m.group()], escaped)
    return "`".join(parts).replace("\n", " ")


def _table(sections: list[Section], headers: tuple[str, ...], intro: str) -> str:
    out = [intro.rstrip(), ""]
    for s in sections:
        out += [f"## {s.title}", ""]
        out += [md(s.intro) if s.intro else UNDOCUMENTED, ""]
        if s.usage:
            out += ["```", s.usage, "```", ""]
        if not s.entries:
            continue
        out += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        for e in s.entries:
            cells = [f"`{e.key}`", e.kind, e.default, md(e.text) if e.text else UNDOCUMENTED]
            out.append("| " + " | ".join(cells[: len(headers)]) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def undocumented(sections: list[Section]) -> list[str]:
    """What the pages show as undocumented: each section without an introduction and each entry
    without a description, by title and key."""
    missing = []
    for s in sections:
        if not s.intro.strip():
            missing.append(s.title)
        missing += [f"{s.title}: {e.key}" for e in s.entries if not e.text.strip()]
    return missing


# --- the run config ----------------------------------------------------------------------------

_PLURAL = {"integer": "integers", "number": "numbers", "string": "strings", "boolean": "booleans"}
_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _toml(value: Any) -> str:
    """A default as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def type_text(tp: Any) -> str:
    """An annotation in TOML's words: `integer`, `one of "hf", "vllm"`, `array of integers`."""
    origin = get_origin(tp)
    if origin is Annotated:
        return type_text(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        parts = [type_text(a) for a in get_args(tp) if a is not type(None)]
        return " or ".join(dict.fromkeys(parts))
    if origin is Literal:
        return "one of " + ", ".join(f"`{_toml(v)}`" for v in get_args(tp))
    if origin in (tuple, list):
        item = type_text(get_args(tp)[0]) if get_args(tp) else "any"
        return f"array of {_PLURAL.get(item, item)}"
    if origin is dict:
        key, value = get_args(tp)
        if get_origin(key) is Literal:
            value_name = type_text(value)
            keys = ", ".join(f"`{k}`" for k in get_args(key))
            return f"table of {_PLURAL.get(value_name, value_name)} by {keys}"
        return "table"
    if tp is Any:
        return "any"
    return _NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def _bounds(info: FieldInfo) -> str:
    signs = {Ge: ("≥", "ge"), Gt: (">", "gt"), Le: ("≤", "le"), Lt: ("<", "lt")}
    out = []
    for m in info.metadata:
        for kind, (sign, attr) in signs.items():
            if isinstance(m, kind):
                out.append(f"{sign} {_toml(getattr(m, attr))}")
    return ", ".join(out)


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    return "unset" if value is None else f"`{_toml(value)}`"


def _table_model(tp: Any) -> type[BaseModel] | None:
    """The model of a field that is a table of its own (`TargetConfig | None` too), else None."""
    for t in [tp, *get_args(tp)]:
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _field_entry(prefix: str, name: str, info: FieldInfo) -> Entry:
    bounds = _bounds(info)
    kind = type_text(info.annotation) + (f", {bounds}" if bounds else "")
    return Entry(f"{prefix}{name}", md(kind), _default(info), info.description or "")


def table_section(model: type[BaseModel], prefix: str, title: str) -> Section:
    """One TOML table: each field of `model` as `<prefix><field>`, its type, default and meaning."""
    entries = [_field_entry(prefix, name, info) for name, info in model.model_fields.items()]
    return Section(title, _intro(model.__doc__), entries)


def _intro(doc: str | None) -> str:
    """A table model's docstring without the table's name, which the heading already says:
    "[train]: the training schedule." becomes "The training schedule."."""
    text = re.sub(r"^\[[^\]]*\]( options)?:\s*", "", (doc or "").strip())
    return text[:1].upper() + text[1:]


def config_sections() -> list[Section]:
    """The top-level keys, the run config's tables in RunConfig's order with `[stages.<name>]`
    among them, then each stage's options."""
    from eyas.state.executiontables import StageConfig
    from eyas.state.runconfig import RunConfig
    from eyas.state.specs import STAGES, NoOptions

    top = Section("Top-level keys", "The keys at the top of the file, before its first table.")
    sections = [top]
    for name, info in RunConfig.model_fields.items():
        model = _table_model(info.annotation)
        if name == "stages":  # a table of tables, one per stage
            sections.append(table_section(StageConfig, "stages.<name>.", "`[stages.<name>]`"))
        elif model is not None:
            sections.append(table_section(model, f"{name}.", f"`[{name}]`"))
        else:
            top.entries.append(_field_entry("", name, info))
    top.entries.append(Entry(*PREFLIGHT_KEY))
    for spec in STAGES.values():
        if spec.options is not NoOptions:
            title = f"`[stages.{spec.name}] options`"
            sections.append(table_section(spec.options, f"stages.{spec.name}.options.", title))
    return sections


CONFIG_INTRO = """# Run configuration reference

Every key a run's TOML file may hold, with its type, default and meaning. This page is generated
from the run config's pydantic models (`state/runconfig.py`, the tables' `state/inputtables.py`,
`state/drafttables.py`, `state/executiontables.py`, `state/regenerate.py` and `state/tracking.py`,
and the stages' options in `state/specs.py`) each time the site is built, so it is as current as
the code. [Writing a run config](../configuration.md) explains how to start one
and what `eyas validate` tells you; "unset" means the key has no value unless written, and the
meaning says what happens then.
"""


def config_markdown(sections: list[Section] | None = None) -> str:
    return _table(
        config_sections() if sections is None else sections, ("key", "type", "default", "meaning"), CONFIG_INTRO
    )


# --- the CLI -----------------------------------------------------------------------------------


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage line on one line, whatever the terminal's width."""
    fmt = argparse.HelpFormatter(parser.prog, width=10_000)
    fmt.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return fmt.format_help().strip()


def _argument(action: argparse.Action) -> Entry:
    flag = action.nargs == 0  # store_true, store_const: a switch with no value
    key = ", ".join(action.option_strings) if action.option_strings else (action.metavar or action.dest)
    if flag:
        kind = "switch"
    elif action.option_strings:
        kind = str(action.metavar or action.dest.upper())
        kind += f" ({type_text(action.type)})" if action.type in (int, float) else ""
    else:  # a positional: its name is the key already
        kind = type_text(action.type or str) + (", optional" if action.nargs == "?" else "")
    if action.required and action.option_strings:
        default = "required"
    elif flag or action.default in (None, argparse.SUPPRESS):
        default = ""
    else:
        default = f"`{action.default}`"
    return Entry(key, md(kind), default, action.help or "")


def cli_sections(parser: argparse.ArgumentParser | None = None) -> list[Section]:
    """One section per command, root first, each subcommand after its parent, in the parser's order."""
    if parser is None:
        from eyas.cli.main import build_parser

        parser = build_parser()
    sections: list[Section] = []

    def walk(p: argparse.ArgumentParser, intro: str) -> None:
        section = Section(p.prog, " ".join(t for t in (intro, p.description or "") if t), usage=_usage(p))
        sections.append(section)
        children = []
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                helps = {c.dest: c.help or "" for c in action._choices_actions}
                children += [(sub, helps.get(name, "")) for name, sub in action.choices.items()]
                continue
            section.entries.append(_argument(action))
        for sub, text in children:
            walk(sub, text)

    walk(parser, "")
    return sections


CLI_INTRO = """# CLI reference

Every `eyas` command and argument with its help, generated from the command's argparse parser
(`eyas.cli.main.build_parser`) each time the site is built, so it matches what `eyas COMMAND --help`
prints. [Using the CLI](../cli.md) tells what the commands are for, what they print and their exit
codes.
"""


def cli_markdown(sections: list[Section] | None = None) -> str:
    return _table(cli_sections() if sections is None else sections, ("argument", "value", "default", "help"), CLI_INTRO)


def pages() -> dict[str, str]:
    """The generated pages by their path under docs/."""
    return {CONFIG_PAGE: config_markdown(), CLI_PAGE: cli_markdown()}


def missing() -> list[str]:
    """Every undocumented entry of both references, page first."""
    return [f"{CONFIG_PAGE}: {m}" for m in undocumented(config_sections())] + [
        f"{CLI_PAGE}: {m}" for m in undocumented(cli_sections())
    ]


def main(argv: list[str] | None = None) -> int:
    """`python -m eyas.cli.reference config|cli`: print a page, for readers without the site."""
    import sys

    which = (argv if argv is not None else sys.argv[1:]) or ["config"]
    pages_by_name = {"config": config_markdown, "cli": cli_markdown}
    if which[0] not in pages_by_name:
        print("usage: python -m eyas.cli.reference config|cli", file=sys.stderr)
        return 2
    print(pages_by_name[which[0]](), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
