# Import each package in turn; one JSON line when an import starts and one with its outcome,
# so a crash of the interpreter (segfault in a native extension) still names the package.
import importlib
import json
import sys
import traceback

try:
    from importlib import metadata
except ImportError:  # Python < 3.8
    metadata = None  # type: ignore[assignment]  # mypy checks as the console's 3.11; hosts may be older

args = json.loads(sys.argv[1])
for module_name, dist_name in args["packages"]:
    print(json.dumps({"start": module_name}), flush=True)
    rec = {"module": module_name, "dist": dist_name}
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:
        rec["ok"] = False
        rec["error"] = "%s: %s" % (type(exc).__name__, exc)
        if not isinstance(exc, ImportError) or getattr(exc, "name", None) != module_name:
            # failed inside the package (a missing shared library, a broken dependency): where, not only what
            rec["traceback_tail"] = traceback.format_exc().strip().splitlines()[-4:]
    else:
        rec["ok"] = True
        rec["file"] = getattr(module, "__file__", None)
        version = None
        if metadata is not None:
            try:
                version = metadata.version(dist_name)
            except metadata.PackageNotFoundError as exc:
                rec["metadata_error"] = "PackageNotFoundError: %s" % exc
        if version is None:
            version = getattr(module, "__version__", None)
        rec["version"] = None if version is None else str(version)
    print(json.dumps(rec), flush=True)
print(json.dumps({"done": True, "executable": sys.executable}), flush=True)
