"""A launch-command wrapper for the identity tests: another process takes the worker's port after
regen checked it was free, then the wrapper execs the real launch line (so regen's launched pid is
the server's).

    python tests/port_grabber.py MODE STATE_DIR -- <launch argv ...>

MODE `http`: a simulator answering under another served-model-name takes the port; the launched
simulator starts slowly (it would fail to bind much later). MODE `socket`: a bare listening socket
takes the port; the launched simulator fails to bind at once (uvicorn's [Errno 98]). MODE `drop-name`:
nothing takes the port; regen's --served-model-name is removed from the launch line (a launch command
that does not pass regen's arguments on).

The other process is detached (double fork, own session): it is not in the launched process tree.
Its pid goes to STATE_DIR/holder.pid; it takes the port once per STATE_DIR (later launches find
STATE_DIR/holder.pid and only exec).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

try:
    from waiting import poll_until  # run as a script: tests/ is sys.path[0]
except ImportError:
    from tests.waiting import poll_until

SOCKET_HOLDER = ("import signal, socket, sys\n"
                 "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                 "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(8)\n"
                 "while True: signal.pause()\n")  # the holder only has to stay alive, until it is killed


def arg_after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def detached(argv: list[str], log: Path) -> int:
    """Start argv outside this process's tree (a double fork); returns its pid."""
    read_end, write_end = os.pipe()
    if os.fork() == 0:  # the middle process: starts the holder in its own session and exits at once
        os.close(read_end)
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        os.write(write_end, str(proc.pid).encode())
        os._exit(0)
    os.close(write_end)
    pid = int(os.read(read_end, 32).decode())
    os.close(read_end)
    os.wait()
    return pid


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_listening(port: int, timeout: float = 60.0) -> None:
    if not poll_until(lambda: _listening(port), timeout, interval=0.1):
        raise SystemExit(f"port_grabber: nothing listens on {port} after {timeout:.0f} s")


def take_port(mode: str, state: Path, launch: list[str]) -> None:
    port = int(arg_after(launch, "--port"))
    if mode == "http":
        holder = [sys.executable, "-m", "engine.simulator", "--model-path", arg_after(launch, "--model-path"),
                  "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "grabbed-after-the-check",
                  "--sim-step-ms", "2", "--sim-output-mean", "24"]
    else:
        holder = [sys.executable, "-c", SOCKET_HOLDER, str(port)]
    pid = detached(holder, state / "holder.log")
    wait_listening(port)
    (state / "holder.pid").write_text(f"{pid}\n")


def main() -> None:
    mode, state = sys.argv[1], Path(sys.argv[2])
    launch = sys.argv[sys.argv.index("--") + 1:]
    if mode in ("http", "socket") and not (state / "holder.pid").exists():
        take_port(mode, state, launch)
        if mode == "http":
            launch += ["--sim-slow-start-s", "60"]  # still loading when regen asks who answers the port
    if mode == "drop-name" and "--served-model-name" in launch:
        i = launch.index("--served-model-name")
        del launch[i:i + 2]
    os.execv(launch[0], launch)


if __name__ == "__main__":
    main()
