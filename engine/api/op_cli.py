"""Each control op's one-shot command line (`python -m engine.ctl --run-dir D <op-name> ...`), derived from its fields:
add_op_commands (the parser), op_of (a parsed command line as its op, through the one codec) and ctl_argv (the
inverse, which the console runs on a host). A required str is a positional, a selection (ops.Selection) its names or
--all, a bool --no-NAME (--NAME when it defaults to false), a number --NAME VALUE.
"""
from __future__ import annotations

import argparse
from enum import StrEnum
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from engine.api.ops import CHANNEL_OPS, AllOrSome, ChannelOp, ControlOp
from engine.api.op_codec import decode_op


class ArgForm(StrEnum):
    POSITIONAL = "positional"  # a required string: `restart-worker gpu1`
    SELECTION = "selection"  # names or --all: `pause s00001 s00002`, `pause --all`
    FLAG = "flag"  # a bool: `status --no-shards`
    OPTION = "option"  # a number with a default (None: not given): `log-tail gpu0 --lines 20`, `follow --since TS`


class UsageError(Exception):
    """A command line that asks for no op (pause with both shard ids and --all, or neither); the text says which."""


def command_name(cls: type[ControlOp]) -> str:
    return cls.op.replace("_", "-")


COMMANDS: dict[str, type[ControlOp]] = {command_name(cls): cls for cls in CHANNEL_OPS}


def arg_form(cls: type[ControlOp], name: str, info: FieldInfo) -> ArgForm:
    if any(isinstance(m, AllOrSome) for m in info.metadata):
        return ArgForm.SELECTION
    if info.annotation is bool:
        return ArgForm.FLAG
    if info.annotation is str and info.is_required():
        return ArgForm.POSITIONAL
    if option_type(info) is not None and not info.is_required():
        return ArgForm.OPTION
    raise TypeError(f"{cls.__name__}.{name}: no command-line form for {info.annotation!r} (engine.api.op_cli)")


def option_type(info: FieldInfo) -> type[int] | type[float] | None:
    """int or float for `int`, `float`, `float | None`, ...; None for any other type."""
    union = get_origin(info.annotation) in (Union, UnionType)
    kinds = set(get_args(info.annotation)) - {type(None)} if union else {info.annotation}
    if kinds == {int}:
        return int
    if kinds == {float}:
        return float
    return None


def arguments(cls: type[ControlOp]) -> list[tuple[str, FieldInfo, ArgForm]]:
    """The op's arguments (its fields), in order, each with its command-line form."""
    return [(name, info, arg_form(cls, name, info)) for name, info in cls.model_fields.items()]


def _flag(name: str, default: Any) -> str:
    return f"--{'no-' if default else ''}{name.replace('_', '-')}"


def add_op_commands(parser: argparse.ArgumentParser) -> tuple[Any, dict[str, argparse.ArgumentParser]]:
    """The parser's subcommands (dest `op`): one per op (its doc's first line as help), its arguments from its fields;
    returns the subparsers (for commands that are not ops) and each op's parser by name."""
    sub = parser.add_subparsers(dest="op", required=True)
    parsers = {}
    for command, cls in COMMANDS.items():
        p = sub.add_parser(command, help=(cls.__doc__ or "").strip().splitlines()[0])
        for name, info, form in arguments(cls):
            what = info.description or ""
            if form is ArgForm.POSITIONAL:
                p.add_argument(name, help=what)
            elif form is ArgForm.SELECTION:
                p.add_argument(name, nargs="*", help=f"{name} (or --all)")
                p.add_argument("--all", dest=f"all_{name}", action="store_true", help=f"every one of the {name}")
            elif form is ArgForm.FLAG:
                p.add_argument(_flag(name, info.default), dest=name, action="store_false" if info.default else
                               "store_true", help=f"sets {name} to {str(not info.default).lower()}")
            else:
                kind = option_type(info)
                if kind is None:  # arg_form's OPTION is a number's
                    raise TypeError(f"{cls.__name__}.{name}: an option that is not a number (engine.api.op_cli)")
                p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=info.default, help=what)
        parsers[command] = p
    return sub, parsers


def op_of(args: argparse.Namespace) -> ChannelOp:
    """The op a command line parsed by add_op_commands' parser asks for, read through the one codec: ControlError
    names a field whose value is not what it must be, UsageError a selection given both ways or neither."""
    command = args.op
    cls = COMMANDS[command]
    data: dict[str, Any] = {"op": cls.op}
    for name, _info, form in arguments(cls):
        value = getattr(args, name)
        if form is ArgForm.SELECTION:
            every = getattr(args, f"all_{name}")
            if every == bool(value):
                raise UsageError(f"{command}: give {name[:-1] if name.endswith('s') else name} ids or --all (not both)")
            value = "all" if every else list(value)
        data[name] = value
    return decode_op(data)


def ctl_argv(op: ChannelOp) -> list[str]:
    """The one-shot form's arguments for an op (`python -m engine.ctl --run-dir D <these>`), which every engine
    version's engine.ctl parses (hello excepted: an engine that has it has the channel)."""
    cls = type(op)
    argv = [command_name(cls)]
    for name, info, form in arguments(cls):
        value = getattr(op, name)
        if form is ArgForm.POSITIONAL:
            argv.append(value)
        elif form is ArgForm.SELECTION:
            argv.extend(["--all"] if value is None else value)
        elif form is ArgForm.FLAG:
            if value != info.default:
                argv.append(_flag(name, info.default))
        elif value is not None:
            argv.extend([f"--{name.replace('_', '-')}", str(value)])
    return argv
