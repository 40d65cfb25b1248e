"""Does an installed SGLang still default its scheduler as the simulator's profile models it?

Reads the package's srt/environ.py as text (sglang is never imported); `python -m engine.simulator.sglang_check`.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

from engine.simulator.kv_budget import ENV_FIELDS, SchedulingDefaults
from engine.simulator.profiles import DEFAULT_VERSION, Profile, profile_for

_ENV_LINE = re.compile(r"^\s*(SGLANG_\w+)\s*=\s*Env(?:Int|Float|Bool|Str)\(\s*([^,)]*)", re.MULTILINE)


def installed_environ_py() -> Path | None:
    """srt/environ.py of the sglang package on sys.path, or None when there is none."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "srt" / "environ.py"
    return path if path.is_file() else None


def read_defaults(environ_py: Path) -> dict[str, str]:
    """SGLANG_NAME -> its default as written in environ.py (`SGLANG_X = EnvInt(4096)` -> "4096")."""
    return {name: value.strip() for name, value in _ENV_LINE.findall(environ_py.read_text(errors="replace"))}


def differences(found: dict[str, str], modelled: SchedulingDefaults) -> list[str]:
    """One line per modelled default the installed environ.py sets otherwise (one it lacks is not compared)."""
    out = []
    for name, attr in ENV_FIELDS.items():
        if name not in found:
            continue
        ours = getattr(modelled, attr)
        try:
            same = type(ours)(float(found[name])) == ours
        except ValueError:
            same = False
        if not same:
            out.append(f"{name}: installed {found[name]}, simulated {ours}")
    return out


def check_installed(profile: Profile) -> str | None:
    """A startup-log line comparing an installed sglang's defaults with `profile`'s; None when none is installed."""
    environ_py = installed_environ_py()
    if environ_py is None:
        return None
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = "of unknown version"
    diffs = differences(read_defaults(environ_py), profile.scheduling)
    verdict = "match" if not diffs else "differ: " + "; ".join(diffs)
    return (f"Simulator: the installed sglang {version} ({environ_py}) scheduler defaults {verdict} "
            f"(simulated profile {profile.version})")


def main(argv: list[str] | None = None) -> int:
    """Print the comparison for --sim-sglang-version V (default the newest); exit 1 when a default differs."""
    args = sys.argv[1:] if argv is None else argv
    version = args[args.index("--sim-sglang-version") + 1] if "--sim-sglang-version" in args else DEFAULT_VERSION
    line = check_installed(profile_for(version))
    print(line or "Simulator: no sglang package is importable here; nothing to compare")
    return 1 if line and " differ: " in line else 0


if __name__ == "__main__":
    raise SystemExit(main())
