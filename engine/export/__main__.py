"""`python -m engine.export`: what `regen export HOST:DIR` runs on the host; prints one JSON object (last line).

Exit status: 0 exported (or --verify: the export matches its manifest), 1 --verify found a mismatch,
2 nothing could be exported or verified (the JSON's "error" says why).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.export.cli_args import add_export_arguments, options_from
from engine.export.run import SCHEMA, export_run
from engine.export.source import ExportError
from engine.export.verify import SCHEMA as VERIFY_SCHEMA, verify_export
from engine.store.manifest import ManifestError

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.export", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", default=None)
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    add_export_arguments(parser)
    args = parser.parse_args(argv)
    if args.verify:
        try:
            result = verify_export(Path(args.verify))
        except ManifestError as exc:
            print(json.dumps({"schema": VERIFY_SCHEMA, "error": str(exc)}))
            return EXIT_ERROR
        print(json.dumps(result.to_dict()))
        return EXIT_OK if result.ok else EXIT_MISMATCH
    try:
        if not args.run_dir:
            raise ValueError("give the run dir to export (or --verify PATH)")
        opts = options_from(args, args.run_dir)
        exported = export_run(opts)
    except (ValueError, ExportError) as exc:
        print(json.dumps({"schema": SCHEMA, "error": str(exc)}))
        return EXIT_ERROR
    print(json.dumps(exported.to_dict()))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
