"""A multi-node server's rendezvous (`--nnodes N --node-rank i --dist-init-addr HOST:PORT`), as torch.distributed's.

Rank 0 waits on the dist-init address until every other rank has joined; each joiner keeps its connection for the
server's life, and either side seeing it close loses that rank (SGLang's NCCL "remote process exited").
A joiner says who it is in one JSON line; rank 0 answers `ok` or `error <why>`.
"""
from __future__ import annotations

import asyncio
import errno
import json
import time
from dataclasses import dataclass
from typing import Callable

# torch.distributed's default init timeout (SGLang's --dist-timeout unset)
DEFAULT_TIMEOUT_S = 600.0
RETRY_S = 0.1


class DistError(Exception):
    """The rendezvous failed; the message is torch's line for it."""


@dataclass(frozen=True)
class DistAddr:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_dist_addr(text: str) -> DistAddr:
    """HOST:PORT or [IPv6]:PORT; ValueError with SGLang's wording when it is neither."""
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    bare_v6 = ":" in host and not text.startswith("[")
    if not sep or not host or bare_v6 or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"--dist-init-addr {text}: please provide --dist-init-addr as host:port of head node")
    return DistAddr(host, int(port))


@dataclass(frozen=True)
class Joiner:
    node_rank: int
    peer: str  # host:port of its connection, as rank 0 sees it


def _peer(writer: asyncio.StreamWriter) -> str:
    info = writer.get_extra_info("peername")
    return f"{info[0]}<{info[1]}>" if info else "unknown"


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """A joined connection carries nothing more: its end (EOF or a reset) is the other side's loss."""
    try:
        await reader.read()
    except OSError:
        return  # reset by the peer: lost as well


class Rendezvous:
    """Rank 0's side: the dist-init listener and the connections of ranks 1..nnodes-1."""

    def __init__(self, addr: DistAddr, nnodes: int, tp_size: int, on_lost: Callable[[Joiner], None]):
        self.addr, self.nnodes, self.tp_size, self.on_lost = addr, nnodes, tp_size, on_lost
        self.joined: dict[int, Joiner] = {}
        self._writers: list[asyncio.StreamWriter] = []
        self._all = asyncio.Event()
        self._server: asyncio.base_events.Server | None = None
        self._closing = False

    async def open(self) -> None:
        try:
            self._server = await asyncio.start_server(self._accept, self.addr.host, self.addr.port, reuse_address=True)
        except OSError as exc:
            code = errno.errorcode.get(exc.errno or 0, "EUNKNOWN")
            raise DistError(
                "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
                f"address. port: {self.addr.port}, useIpv6: {str(':' in self.addr.host).lower()}, code: "
                f"{-(exc.errno or 0)}, name: {code}, message: {(exc.strerror or str(exc)).lower()}") from exc
        if self.nnodes == 1:
            self._all.set()

    async def wait_all(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._all.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise DistError(f"torch.distributed.DistStoreError: Timed out after {timeout_s:.0f} seconds waiting for "
                            f"clients. {len(self.joined) + 1}/{self.nnodes} clients joined.") from None

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            w.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        try:
            hello = json.loads(await reader.readline())
            rank = int(hello["node_rank"])
        except (ValueError, KeyError, TypeError, OSError):
            writer.close()
            return  # not one of ours (a port scan, a reset): nothing joined
        problem = self._problem(rank, hello)
        if problem:
            writer.write(f"error {problem}\n".encode())
            await writer.drain()
            writer.close()
            return
        joiner = Joiner(rank, _peer(writer))
        self.joined[rank] = joiner
        writer.write(b"ok\n")
        await writer.drain()
        if len(self.joined) == self.nnodes - 1:
            self._all.set()
        await _until_closed(reader)
        if not self._closing:
            self.on_lost(joiner)

    def _problem(self, rank: int, hello: dict) -> str:
        if hello.get("nnodes") != self.nnodes or hello.get("tp_size") != self.tp_size:
            return (f"node rank {rank} was launched with --nnodes {hello.get('nnodes')} --tp-size "
                    f"{hello.get('tp_size')}, rank 0 with --nnodes {self.nnodes} --tp-size {self.tp_size}")
        if not 0 < rank < self.nnodes:
            return f"node rank {rank} is not in 1..{self.nnodes - 1}"
        if rank in self.joined:
            return f"node rank {rank} has already joined (from {self.joined[rank].peer})"
        return ""


class Member:
    """A rank > 0's side: one connection to rank 0, kept until either ends."""

    def __init__(self, addr: DistAddr, node_rank: int, nnodes: int, tp_size: int, on_lost: Callable[[], None]):
        self.addr, self.node_rank, self.nnodes, self.tp_size, self.on_lost = addr, node_rank, nnodes, tp_size, on_lost
        self._writer: asyncio.StreamWriter | None = None
        self._watch: asyncio.Task | None = None
        self._closing = False

    async def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:  # rank 0 may not listen yet: torch's store client retries until its timeout
            try:
                reader, writer = await asyncio.open_connection(self.addr.host, self.addr.port)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise DistError(f"torch.distributed.DistNetworkError: The client socket has timed out after "
                                    f"{timeout_s * 1000:.0f}ms while trying to connect to ({self.addr.host}, "
                                    f"{self.addr.port}).") from None
                await asyncio.sleep(RETRY_S)
        hello = {"node_rank": self.node_rank, "nnodes": self.nnodes, "tp_size": self.tp_size}
        writer.write(json.dumps(hello).encode() + b"\n")
        await writer.drain()
        answer = (await reader.readline()).decode().strip()
        if answer != "ok":
            writer.close()
            raise DistError(f"torch.distributed.DistStoreError: rank 0 at {self.addr} refused node rank "
                            f"{self.node_rank}: {answer.removeprefix('error ') or 'connection closed'}")
        self._writer = writer
        self._watch = asyncio.get_running_loop().create_task(self._wait_lost(reader), name="dist-member")

    async def _wait_lost(self, reader: asyncio.StreamReader) -> None:
        await _until_closed(reader)
        if not self._closing:
            self.on_lost()

    async def close(self) -> None:
        self._closing = True
        if self._writer is not None:
            self._writer.close()
        if self._watch is not None:
            self._watch.cancel()
