# The run dir: absent (new run), empty, or an existing run whose frozen content hash we read from state.sqlite.
import json
import os
import sqlite3
import sys

args = json.loads(sys.argv[1])
run_dir = os.path.expanduser(args["run_dir"])
out = {"run_dir": run_dir}
try:
    st = os.stat(run_dir)
except FileNotFoundError as exc:
    out["exists"] = False
    out["stat_error"] = str(exc)
    print(json.dumps(out))
    sys.exit(0)
except OSError as exc:
    out["exists"] = None
    out["error"] = str(exc)
    print(json.dumps(out))
    sys.exit(0)
out["exists"] = True
out["is_dir"] = os.path.isdir(run_dir)
if out["is_dir"]:
    try:
        entries = sorted(os.listdir(run_dir))
    except OSError as exc:
        out["error"] = str(exc)
        entries = []
    out["entries"] = entries[:50]
    out["entry_count"] = len(entries)
    out["writable"] = os.access(run_dir, os.W_OK)
    out["run_toml"] = os.path.isfile(os.path.join(run_dir, "run.toml"))
    # `regen start` deploys into .regen/ before the supervisor accepts the config and writes run.toml
    out["deployed"] = os.path.isdir(os.path.join(run_dir, ".regen"))
    db = os.path.join(run_dir, "state.sqlite")
    out["state_db"] = os.path.isfile(db)
    if out["state_db"]:
        try:
            conn = sqlite3.connect("file:%s?mode=ro" % db, uri=True, timeout=10)
            try:
                rows = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('content_hash', 'content_fields')"))
                out["content_hash"] = rows.get("content_hash")
                out["content_fields"] = json.loads(rows["content_fields"]) if rows.get("content_fields") else None
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                if "samples" in tables:
                    out["samples_committed"] = conn.execute("SELECT count(*) FROM samples").fetchone()[0]
                if "parts" in tables:
                    out["parts"] = conn.execute("SELECT count(*) FROM parts").fetchone()[0]
            finally:
                conn.close()
        except (sqlite3.Error, ValueError) as exc:
            out["db_error"] = "%s: %s" % (type(exc).__name__, exc)
    pid_file = os.path.join(run_dir, "supervisor.pid")
    if os.path.isfile(pid_file):
        try:
            with open(pid_file) as f:
                pid = int(f.read().split()[0])
            out["supervisor_pid"] = pid
            try:
                os.kill(pid, 0)
                out["supervisor_alive"] = True
            except ProcessLookupError:
                out["supervisor_alive"] = False
            except PermissionError:
                out["supervisor_alive"] = True  # exists, owned by someone else
        except (OSError, ValueError, IndexError) as exc:
            out["supervisor_pid_error"] = "%s: %s" % (type(exc).__name__, exc)
else:
    out["mode"] = oct(st.st_mode)
print(json.dumps(out))
