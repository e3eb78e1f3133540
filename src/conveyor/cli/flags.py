"""Command-line flags made from config dataclasses: one flag per field, help from its docstring.

add_dataclass_flags(parser, PipelineConfig)             # --num-microbatches, --schedule, ...
config = build_dataclass(PipelineConfig, args, toml)    # TOML values, then the flags given
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

__all__: list[str] = []


def add_dataclass_flags(
    parser: argparse.ArgumentParser, cls: type, skip: Sequence[str] = ()
) -> None:
    """One ``--field-name`` flag per dataclass field (but ``skip``); help comes from the
    field's docstring."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind, nargs, choices = _flag_type(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = f"{docs.get(field.name, '')} (default: {default})"
        if field.metadata.get("deprecated"):
            help_text = argparse.SUPPRESS  # still taken, with the config's warning
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(
                flag, type=kind, nargs=nargs, choices=choices, default=None, help=help_text
            )


def build_dataclass(cls: type, args: argparse.Namespace, values: Mapping[str, Any]) -> Any:
    """An instance of ``cls`` from TOML ``values`` overridden by the flags that were given."""
    return cls(**given_fields(cls, args, values))


def given_fields(cls: type, args: argparse.Namespace, values: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``cls`` that TOML ``values`` or the flags set (flags win); lists as
    tuples."""
    names = {f.name for f in dataclasses.fields(cls)}
    fields = {k: v for k, v in values.items() if k in names}
    fields.update({k: v for k, v in vars(args).items() if k in names and v is not None})
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


def read_toml(path: Path, *classes: type) -> dict[str, Any]:
    """A TOML file's values, each a field of one of the dataclasses ``classes``.

    Raises:
        ValueError: a key names no field (a typo would otherwise be dropped silently).
    """
    with path.open("rb") as file:
        values = tomllib.load(file)
    known = {f.name for cls in classes for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"{path} sets unknown fields {unknown}; expected fields of "
            f"{', '.join(cls.__name__ for cls in classes)}: {sorted(known)}"
        )
    return values


def _flag_type(hint: Any) -> tuple[type, str | None, list[str] | None]:
    """The argparse type, nargs and choices for a field's type hint."""
    options = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = options[0]
    nargs = None
    if typing.get_origin(hint) is tuple:
        hint, nargs = typing.get_args(hint)[0], "+"
    if typing.get_origin(hint) is typing.Literal:
        return str, nargs, [str(a) for a in typing.get_args(hint)]
    return hint, nargs, None


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written beneath dataclass fields (of ``cls`` and its base classes), read
    from the source, as argparse help."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(inspect.getsource(klass))
        body = tree.body[0].body  # type: ignore[attr-defined]  # the class definition
        for field, doc in itertools.pairwise(body):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
            ):
                # argparse formats help with %: a literal one must be doubled
                docs[field.target.id] = " ".join(str(doc.value.value).split()).replace("%", "%%")
    return docs
