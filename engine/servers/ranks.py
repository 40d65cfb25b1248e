"""One SGLang server across several nodes: its ranks (node, node rank, GPUs, dist-init address) and each rank's launch.

Each node runs the same launch line plus `--nnodes N --node-rank i --dist-init-addr HOST:PORT` (`--tp-size` is the
total); rank 0 serves the HTTP API, ranks > 0 only a dummy /health. Pure: a placement backend launches each rank."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# SGLang's multi-node ZMQ sockets use the ports just above the dist-init port on rank 0's node (PortArgs.init_new:
# port_base = dist_init_port + 1, then up to port_base + 5, more with DP attention): keep this many free
DIST_PORT_SPAN = 8
RANK_FLAGS = ("--nnodes", "--node-rank", "--dist-init-addr", "--nccl-init-addr")


class RankPlanError(ValueError):
    """A multi-node server that cannot be laid out; the message names the value and the fix."""


@dataclass(frozen=True)
class DistInitAddr:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ServerRank:
    """One node's part of a multi-node server."""
    server: str  # the server's name in regen
    node: str  # where this rank runs (a host name or address the backend launches on)
    node_rank: int
    nnodes: int
    gpus: tuple[int, ...]  # GPU indices on its node
    dist_init: DistInitAddr

    @property
    def serves_http(self) -> bool:
        return self.node_rank == 0

    @property
    def tp_size(self) -> int:
        """The server's total TP size, what --tp-size says on every rank."""
        return len(self.gpus) * self.nnodes

    @property
    def tp_ranks(self) -> range:
        return range(self.node_rank * len(self.gpus), (self.node_rank + 1) * len(self.gpus))

    def flags(self) -> list[str]:
        return ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                "--dist-init-addr", str(self.dist_init)]


@dataclass(frozen=True)
class MultiNodeServer:
    name: str
    ranks: tuple[ServerRank, ...]
    port: int  # rank 0's HTTP port (each rank > 0's dummy /health listens on the same port on its node)

    @property
    def head(self) -> ServerRank:
        return self.ranks[0]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(r.node for r in self.ranks)

    @property
    def tp_size(self) -> int:
        return self.head.tp_size


def plan_server(name: str, nodes: Sequence[str], gpus: Sequence[int], *, port: int, dist_init_port: int,
                dist_init_host: str | None = None) -> MultiNodeServer:
    """A server named `name` over `nodes` (rank i on nodes[i]), each giving it the same `gpus`; rank 0's node
    listens on `dist_init_port` (at `dist_init_host`, default nodes[0]: the address the other nodes reach it at)."""
    if not nodes:
        raise RankPlanError(f"server {name}: no nodes given; a multi-node server needs at least one")
    repeated = sorted({n for n in nodes if list(nodes).count(n) > 1})
    if repeated:
        raise RankPlanError(f"server {name}: node(s) {', '.join(repeated)} given twice; each rank needs its own node")
    if not gpus or len(set(gpus)) != len(gpus):
        raise RankPlanError(f"server {name}: gpus {list(gpus)} must be distinct GPU indices, at least one")
    for what, value in (("port", port), ("dist_init_port", dist_init_port)):
        if not 0 < value <= 65535:
            raise RankPlanError(f"server {name}: {what} {value} is not a TCP port (1..65535)")
    if dist_init_port + DIST_PORT_SPAN > 65535:
        raise RankPlanError(f"server {name}: dist_init_port {dist_init_port}: SGLang also uses the {DIST_PORT_SPAN} "
                            f"ports above it; choose one below {65535 - DIST_PORT_SPAN}")
    if port == dist_init_port or dist_init_port < port <= dist_init_port + DIST_PORT_SPAN:
        raise RankPlanError(f"server {name}: port {port} falls in the dist-init ports {dist_init_port}.."
                            f"{dist_init_port + DIST_PORT_SPAN}; move one of them")
    addr = DistInitAddr(dist_init_host or nodes[0], dist_init_port)
    ranks = tuple(ServerRank(server=name, node=node, node_rank=i, nnodes=len(nodes), gpus=tuple(gpus), dist_init=addr)
                  for i, node in enumerate(nodes))
    return MultiNodeServer(name=name, ranks=ranks, port=port)


def rank_argv(argv: Sequence[str], rank: ServerRank) -> list[str]:
    """`argv` (a server's launch line, --tp-size the total) with this rank's flags; refused when the operator's
    line already sets one of them, since each rank needs its own."""
    for word in argv:
        flag = word.split("=", 1)[0]
        if flag in RANK_FLAGS:
            raise RankPlanError(f"the launch line sets {flag}: remove it from workers.launch / extra_args; regen sets "
                                f"{', '.join(RANK_FLAGS[:3])} for each rank of a multi-node server")
    return [*argv, *rank.flags()]
