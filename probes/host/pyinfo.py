# Host interpreter facts. Kept to syntax any Python parses, so an old interpreter still reports its version.
import json
import os
import platform
import sys

print(json.dumps({
    "executable": sys.executable,
    "version": list(sys.version_info[:3]),
    "version_text": sys.version,
    "prefix": sys.prefix,
    "base_prefix": getattr(sys, "base_prefix", sys.prefix),
    "platform": platform.platform(),
    "cwd": os.getcwd(),
}))
