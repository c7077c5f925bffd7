"""A TOML table checked against a pydantic model, every mistake turned into one line its author can act on.

`Report.table()` validates a table with its model and records, instead of raising, one
`<file>: <key>: <problem>; <fix>` line per mistake: unknown keys with a did-you-mean, then the
keys' own mistakes in the model's field order, a missing key last. The lines are written from the
model's declarations (the bounds of `Field(ge=...)`, the choices of a `Literal`), so that a bound
is stated once, where it is enforced. Validators raise `ValueError("problem; fix")`, one line per
problem, for what a declaration cannot say.

`read_toml()` reads the file itself, its syntax errors one line too; `AbsPath` is a path key
relative to the file's folder. Used for the run config and the stages' options (state/runconfig.py
and the tables it holds); pydantic and stdlib only.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, BeforeValidator, ValidationError, ValidationInfo
from pydantic.fields import FieldInfo


class ConfigError(ValueError):
    """Every mistake found in a config, one line each."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


_TOML_TYPES = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", tuple: "array"}

# What a strict type error expected, in TOML's words; the plural names the items of an array.
_EXPECTED = {
    "int_type": ("an integer", "integers"),
    "float_type": ("a number", "numbers"),
    "string_type": ("a string", "strings"),
    "bool_type": ("true or false", "true or false"),
    "dict_type": ("a table", "tables"),
    "list_type": ("an array", "arrays"),
    "tuple_type": ("an array", "arrays"),
}
_RANGE = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}


def is_int(v: Any) -> bool:
    """An integer as TOML writes one: `true` is not 1."""
    return isinstance(v, int) and not isinstance(v, bool)


def describe(value: Any) -> str:
    """`string '1e-4x'`, `integer 3`, `a table`: how the TOML value looks to its author."""
    if isinstance(value, dict):
        return "a table"
    kind = _TOML_TYPES.get(type(value), type(value).__name__)
    # JSON spells booleans and arrays the way TOML does (true, [1, 2]); repr quotes strings 'so'.
    shown = json.dumps(value, default=str) if isinstance(value, (bool, list, tuple)) else repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"{kind} {shown}"


def _types(annotation: Any) -> list[Any]:
    """The members of a union (`int | None` -> [int, NoneType]), else [annotation]."""
    if get_origin(annotation) in (Union, types.UnionType):
        return [t for arg in get_args(annotation) for t in _types(arg)]
    return [annotation]


def _choices(annotation: Any) -> tuple[str, ...]:
    for t in _types(annotation):
        if get_origin(t) is Literal:
            return get_args(t)
    return ()


def _out_of_range(field: FieldInfo, value: Any) -> str:
    """The field's bounds, read from its declaration, as a fix."""
    lo = hi = None
    lo_open = hi_open = False
    for m in field.metadata:
        if isinstance(m, Ge):
            lo = m.ge
        elif isinstance(m, Gt):
            lo, lo_open = m.gt, True
        elif isinstance(m, Le):
            hi = m.le
        elif isinstance(m, Lt):
            hi, hi_open = m.lt, True
    if int in _types(field.annotation):
        if hi is None:
            return f"{value} is out of range; use an integer >= {lo}"
        return f"{value} is out of range {lo}..{hi}; use an integer from {lo} to {hi}"
    bounds = [f"{'>' if lo_open else '>='} {lo:g}"] if lo is not None else []
    if hi is not None:
        bounds.append(f"{'<' if hi_open else '<='} {hi:g}")
    return f"{value!r} is out of range; use a number {' and '.join(bounds) or 'that is finite'}"


def explain(model: type[BaseModel], err: dict[str, Any]) -> list[tuple[str, str]]:
    """One pydantic error of `model` as (key within the table, "problem; fix") pairs."""
    loc, kind, value = err["loc"], err["type"], err.get("input")
    key = ".".join(p for p in loc if isinstance(p, str))
    field = model.model_fields.get(loc[0]) if loc and isinstance(loc[0], str) else None
    if kind == "missing":
        extra = field.json_schema_extra if field is not None and isinstance(field.json_schema_extra, dict) else {}
        return [(key, f"missing; {extra.get('missing', 'add it')}")]
    if kind == "value_error":
        return [(key, line) for line in str(err["ctx"]["error"]).splitlines()]
    if kind == "literal_error" and field is not None:
        choices = _choices(field.annotation)
        if not isinstance(value, str):
            return [(key, f"expected a string, got {describe(value)}; use one of: {', '.join(choices)}")]
        close = difflib.get_close_matches(value, choices, n=1)
        hint = (
            f"did you mean '{close[0]}'? (one of: {', '.join(choices)})"
            if close
            else f"use one of: {', '.join(choices)}"
        )
        return [(key, f"unknown value '{value}'; {hint}")]
    if kind in _RANGE and field is not None:
        return [(key, _out_of_range(field, value))]
    if kind in _EXPECTED:
        one, many = _EXPECTED[kind]
        in_array = any(isinstance(p, int) for p in loc)
        text = f"expected {many if in_array else one}, got {describe(value)}"
        return [(key, text + ("; write it as { key = value, ... }" if kind == "dict_type" else ""))]
    return [(key, err["msg"])]


def _path(value: Any, info: ValidationInfo) -> str:
    """An absolute path: a relative one counts from the TOML file's folder, the validation context's
    base_dir. Without one (from_dict, direct construction) the path is kept as given."""
    if not isinstance(value, str):
        raise ValueError(f"expected a path string, got {describe(value)}")
    if not value.strip():
        raise ValueError("empty; write a path, relative to this file's folder or absolute")
    base = (info.context or {}).get("base_dir")
    return os.path.normpath(base / Path(value).expanduser()) if base is not None else value


AbsPath = Annotated[str, BeforeValidator(_path)]


class Report:
    """Collects one line per mistake instead of raising, so that one pass reports them all."""

    def __init__(self, source: str | None):
        self.source = source  # the file; None: lines start at the key
        self.errors: list[str] = []
        self.rejected: set[str] = set()  # full keys whose values failed their checks

    def error(self, key: str, text: str) -> None:
        self.errors.append(f"{key}: {text}" if self.source is None else f"{self.source}: {key}: {text}")

    def ok(self, key: str) -> bool:
        """`key` (full) holds its file's value or its default, not a default in place of a rejected value."""
        return key not in self.rejected

    def unknown_keys(self, table: dict, prefix: str, allowed: list[str], none_hint: str | None = None) -> None:
        for key in table:
            if key in allowed:
                continue
            close = difflib.get_close_matches(str(key), allowed, n=1)
            if close:
                self.error(f"{prefix}{key}", f"unknown key; did you mean '{prefix}{close[0]}'?")
            elif not allowed:
                self.error(f"{prefix}{key}", f"unknown key; {none_hint or 'this table takes no keys, so remove it'}")
            else:
                self.error(f"{prefix}{key}", f"unknown key; valid keys: {', '.join(allowed)}")

    def section(self, data: dict, key: str, model: type[BaseModel], context: dict | None = None) -> Any:
        """The table `key` of the file as a `model`; None when absent, not a table, or unusable."""
        if key not in data:
            return None
        if not isinstance(data[key], dict):
            self.error(key, f"expected a table, got {describe(data[key])}; write it as [{key}]")
            return None
        return self.table(model, data[key], f"{key}.", context)

    def table(
        self,
        model: type[BaseModel],
        table: dict,
        prefix: str,
        context: dict | None = None,
        none_hint: str | None = None,
    ) -> Any:
        """`table` (its keys under `prefix`, e.g. "train.") as a `model`, its mistakes recorded.

        A rejected value takes its default, so that the checks that follow still run on the rest
        (as the old hand checker did); None when a required key is missing or rejected."""
        self.unknown_keys(table, prefix, list(model.model_fields), none_hint)
        known = {k: v for k, v in table.items() if k in model.model_fields}
        try:
            return model.model_validate(known, context=context)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
        # pydantic reports in field order; a missing key goes last, after what is there to fix.
        for err in sorted(errors, key=lambda e: e["type"] == "missing"):
            for key, text in explain(model, err):
                self.error(f"{prefix}{key}" if key else prefix.rstrip("."), text)
        bad = {e["loc"][0] for e in errors if e["loc"]}
        self.rejected.update(f"{prefix}{k}" for k in bad)
        if not bad:  # a check across the keys failed: it was reported above
            return None
        try:
            return model.model_validate({k: v for k, v in known.items() if k not in bad}, context=context)
        except ValidationError as exc:
            # A check across the table's keys runs only once they all pass: report it now, not
            # after the next submit. (A missing key fails here again; it is reported above.)
            for err in exc.errors(include_url=False):
                if not err["loc"]:
                    for _, text in explain(model, err):
                        self.error(prefix.rstrip("."), text)
            return None


_TOML_WHERE = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """A TOML file as a dict, or ConfigError with one line: the file, where, what and how to fix it."""
    source = os.fspath(path)
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError([f"{source}: cannot read the file ({exc.strerror or exc}); check the path"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{source}: byte {exc.start}: not UTF-8 text; save the file as UTF-8"]) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib (3.11) puts the position only in the message: "(at line 3, column 5)" or
        # "(at end of document)", which is the last line.
        msg = str(exc)
        m = _TOML_WHERE.search(msg)
        if m:
            where, msg = f"line {m.group(1)}, column {m.group(2)}", msg[: m.start()]
        else:
            where = f"line {max(1, len(text.splitlines()))} (end of file)"
            msg = msg.replace(" (at end of document)", "")
        raise ConfigError(
            [f"{source}: {where}: TOML syntax error: {msg}; fix the syntax there (see https://toml.io)"]
        ) from None
