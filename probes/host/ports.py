# Are the worker ports free on the bind address? For a busy one, who holds it (when /proc lets us see).
import errno
import json
import os
import socket
import sys

args = json.loads(sys.argv[1])
host = args["host"]


def listeners():
    """port -> socket inodes in LISTEN state on IPv4/IPv6 (Linux /proc/net)."""
    found = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.read().splitlines()[1:]
        except OSError as exc:
            found.setdefault("errors", []).append(str(exc))
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "0A":  # 0A = LISTEN
                port = int(parts[1].rsplit(":", 1)[1], 16)
                found.setdefault(port, set()).add(parts[9])
    return found


def holders(inodes):
    out, denied = [], 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError as exc:
        return [], "cannot list /proc: %s" % exc
    for pid in pids:
        fd_dir = "/proc/%s/fd" % pid
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            denied += 1  # another user's process: counted and reported below
            continue
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue  # the fd closed while we looked
            if target.startswith("socket:[") and target[8:-1] in inodes:
                try:
                    with open("/proc/%s/cmdline" % pid, "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
                except OSError as exc:
                    cmd = "(cmdline unreadable: %s)" % exc
                out.append({"pid": int(pid), "cmdline": cmd[:300]})
                break
    note = "%d processes of other users not inspectable (run as root to see them)" % denied if denied else None
    return out, note


def run_servers(run_dir):
    """pid -> worker name, for the servers this run dir launched (workers/<name>/server.pid)."""
    own = {}
    base = os.path.join(os.path.expanduser(run_dir), "workers") if run_dir else None
    if not base or not os.path.isdir(base):
        return own
    for name in sorted(os.listdir(base)):
        try:
            with open(os.path.join(base, name, "server.pid")) as f:
                own[int(f.read().split()[0])] = name
        except (OSError, ValueError, IndexError):
            continue  # no pid file: that worker holds no port of this run
    return own


def ancestors(pid):
    """pid and its parents (a server's listening process may be a child of the pid regen recorded)."""
    chain = []
    while pid > 1 and len(chain) < 16:
        chain.append(pid)
        try:
            with open("/proc/%d/stat" % pid) as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return chain


own_servers = run_servers(args.get("run_dir"))
table = None
results = []
for port in args["ports"]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: TIME_WAIT is no conflict
    rec = {"port": port}
    try:
        s.bind((host, port))
    except OSError as exc:
        rec["free"] = False
        rec["error"] = str(exc)
        rec["errno"] = None if exc.errno is None else errno.errorcode.get(exc.errno, exc.errno)
        if table is None:
            table = listeners()
        inodes = table.get(port, set()) if isinstance(table.get(port), set) else set()
        if inodes:
            rec["holders"], rec["holders_note"] = holders(inodes)
            for h in rec["holders"]:
                worker = next((own_servers[p] for p in ancestors(h["pid"]) if p in own_servers), None)
                if worker:
                    h["run_worker"] = worker  # this run's own server: the run is live
        else:
            rec["holders"], rec["holders_note"] = [], "no listening socket for this port in /proc/net/tcp*"
    else:
        rec["free"] = True
    finally:
        s.close()
    results.append(rec)
print(json.dumps({"host": host, "ports": results, "proc_errors": (table or {}).get("errors")}))
