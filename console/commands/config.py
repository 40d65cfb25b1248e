"""`regen config check FILE` validates a run.toml offline (every error at once: key, value found, fix; exit 0 valid,
1 invalid; --json); `regen config schema` prints its JSON Schema. [sampling] is judged against the servers' SGLang
version where the config names one, else a value some version refuses is a warning."""
from __future__ import annotations

import argparse
import json
import sys

from engine.config.load import ConfigError, ConfigIssue, load_config
from engine.config.schema import RunConfig, config_warnings, sampling_version_check

SCHEMA_ID = "https://regen.invalid/run.toml.schema.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="config_command", required=True)
    check = sub.add_parser("check", help="validate a run.toml offline (exit 0 valid, 1 invalid)",
                           description="validate a run.toml offline: every error at once, each naming its key, the "
                                       "value found and the fix (exit 0 valid, 1 invalid)")
    check.add_argument("file", help="the run config (TOML)")
    check.add_argument("--json", action="store_true", help="print the outcome as JSON")
    sub.add_parser("schema", help="print run.toml's JSON Schema (point an editor's TOML plugin at it)",
                   description="print run.toml's JSON Schema (point an editor's TOML plugin at it)")


def run(args: argparse.Namespace) -> int:
    if args.config_command == "schema":
        sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")
        return 0
    try:
        cfg = load_config(args.file, given_to="`regen config check`")
        refused, version_warnings = sampling_version_check(cfg)
        if refused:
            raise ConfigError([ConfigIssue(key, text, "") for key, text in refused], args.file)
    except ConfigError as exc:
        if args.json:
            sys.stdout.write(json.dumps({"valid": False, **exc.to_dict()}, indent=2) + "\n")
        else:
            print(f"regen config check: {exc}", file=sys.stderr)
        return 1
    warnings = [f"{key}: {text}" for key, text in config_warnings(cfg) + version_warnings]
    if args.json:
        sys.stdout.write(json.dumps({"valid": True, "path": args.file, "errors": [], "warnings": warnings}, indent=2)
                         + "\n")
    else:
        for line in warnings:
            print(f"regen config check: warning: {line}", file=sys.stderr)
        where = f"{len(cfg.hosts)} hosts" if cfg.hosts else f"{len(cfg.workers.groups())} server(s) on GPUs " \
            f"{','.join(map(str, cfg.workers.gpus))}"
        print(f"{args.file}: valid ({where}; run_dir {cfg.run_dir})")
    return 0


def json_schema() -> dict:
    schema = RunConfig.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **schema}
