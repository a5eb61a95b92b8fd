"""Parallel degrees and rank coordinates: which rank is where, and who backs up whom.

``ParallelDims`` is the layout (dp x tp x pp, and how many ranks share a node); ``Topology`` is one
generation's view of it for one rank. Recovery never edits a topology: it builds the next
generation's object, because the spare takes the dead rank's coordinates and everything else
(buddies, groups) follows from them. Rank order is pp-major, then dp, then tp, so the ranks of one
tensor-parallel group are adjacent and share a node.
"""

from __future__ import annotations

from dataclasses import dataclass

from deadpool.policies import buddies_table, wards_table


def zero_stage(value) -> int:
    """``parallel.zero`` as a stage: false / 0 off, true / 1 ZeRO-1, 2 ZeRO-2; anything else is
    refused (a truthy typo must not silently mean ZeRO-1)."""
    if value in (0, 1, 2) and not isinstance(value, float):  # True == 1, False == 0
        return int(value)
    raise ValueError(f"parallel.zero must be false/0 (off), true/1 (ZeRO-1: optimizer state "
                     f"sharded) or 2 (ZeRO-2: gradients sharded too), got {value!r}")


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int = 1
    pp: int = 1
    ranks_per_node: int = 1
    zero: int = 1  # ZeRO stage: 0 off, 1 the optimizer state sharded over dp, 2 the gradients too
    nodes_per_rack: int = 1  # nodes behind one rack switch (a failure domain of its own)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B; 1: plain 1F1B)

    @classmethod
    def from_config(cls, parallel: dict) -> "ParallelDims":
        """The degrees of a ``parallel`` config group (``conf/parallel``). Without
        ``ranks_per_node`` (a what-if estimate) a node holds one tensor-parallel group."""
        tp = int(parallel.get("tp", 1))
        return cls(int(parallel["dp"]), tp, int(parallel.get("pp", 1)),
                   int(parallel.get("ranks_per_node", tp)), zero_stage(parallel.get("zero", True)),
                   int(parallel.get("nodes_per_rack", 1)),
                   int(1 if parallel.get("virtual_stages") is None else parallel["virtual_stages"]))

    @classmethod
    def from_layout(cls, layout: dict) -> "ParallelDims":
        """The degrees a checkpoint recorded (``layout``), one tensor-parallel group per node."""
        tp = int(layout.get("tp", 1))
        return cls(int(layout["dp"]), tp, int(layout.get("pp", 1)), ranks_per_node=tp,
                   virtual_stages=int(layout.get("virtual_stages", 1)))

    def __post_init__(self):
        zero_stage(self.zero)
        for axis in ("dp", "tp", "pp", "ranks_per_node", "nodes_per_rack", "virtual_stages"):
            if getattr(self, axis) < 1:
                raise ValueError(f"parallel.{axis} must be >= 1, got {getattr(self, axis)}")
        if self.virtual_stages > 1 and self.pp < 2:
            raise ValueError(f"parallel.virtual_stages={self.virtual_stages} interleaves pipeline "
                             f"stages: it needs parallel.pp >= 2, got pp={self.pp}")
        if self.world_size > self.ranks_per_node and self.world_size % self.ranks_per_node:
            raise ValueError(
                f"world size {self.world_size} (dp*tp*pp) is not a multiple of "
                f"ranks_per_node={self.ranks_per_node}")
        if self.tp > 1 and self.ranks_per_node % self.tp:
            raise ValueError("a tensor-parallel group must fit inside one node (ranks_per_node % tp == 0)")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def layout(self) -> dict[str, int]:
        """The degrees a checkpoint records (meta.json), so a job at another width can load it
        (``virtual_stages`` only when interleaved: which layers a rank holds depends on it)."""
        out = {"dp": self.dp, "tp": self.tp, "pp": self.pp}
        if self.virtual_stages > 1:
            out["virtual_stages"] = self.virtual_stages
        return out

    @property
    def optimizer_sharded(self) -> bool:
        """Each rank holds an optimizer shard no data-parallel peer has (ZeRO-1 with dp > 1)."""
        return self.zero >= 1 and self.dp > 1

    def replica_region(self, replicate: str) -> str:
        """What a buddy holds of each rank's state in this layout (``replica_region``): the
        parameters are shared when dp > 1; an optimizer shard is unique (with dp == 1 all is)."""
        return replica_region(replicate, self.dp > 1, self.optimizer_sharded or self.dp == 1)

    def coords(self, rank: int) -> dict[str, int]:
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return {"pp": pp, "dp": dp, "tp": tp}

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def axis_group(self, axis: str, rank: int) -> list[int]:
        """``rank``'s group along one mesh axis, sorted (O(degree), unlike ``axis_groups``)."""
        c = self.coords(rank)
        return [self.rank_of(**dict(c, **{axis: i})) for i in range(getattr(self, axis))]

    def axis_groups(self, axis: str) -> list[list[int]]:
        """All groups along one mesh axis, each a sorted list of ranks."""
        others = [a for a in ("pp", "dp", "tp") if a != axis]
        groups: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            groups.setdefault(tuple(c[a] for a in others), []).append(r)
        return list(groups.values())

    def state_peers(self, rank: int) -> list[int]:
        """Ranks whose whole training state equals ``rank``'s at every step: its data-parallel
        peers (same pp and tp coordinates; parameters and optimizer state are replicated across
        the data-parallel group, gradients all-reduced bit-identically). A sharded optimizer
        would make this empty for optimizer state."""
        return self.axis_group("dp", rank)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def rack_of(self, rank: int) -> int:
        return self.node_of(rank) // self.nodes_per_rack

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.world_size // self.ranks_per_node))


def replica_region(replicate: str, has_shared: bool, has_unique: bool) -> str:
    """What a rank's buddy holds of its snapshot (``deadpool.snapshot``'s regions): ``all``
    (``ft.replicate=full``, or nothing is shared with a data-parallel peer, e.g. dp == 1),
    ``unique`` (its optimizer shard: a live peer holds the parameters) or ``none`` (peers hold
    everything; nobody needs a replica)."""
    if replicate not in ("unique", "full"):
        raise ValueError(f"ft.replicate must be 'unique' or 'full', got {replicate!r}")
    if replicate == "full" or not has_shared:
        return "all"
    return "unique" if has_unique else "none"


def layer_range(n_layers: int, pp: int, pp_rank: int) -> range:
    """Global indices of the layers of pipeline stage ``pp_rank``: an even split, the first
    ``n_layers % pp`` stages taking one more."""
    base, extra = divmod(n_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


def layer_chunks(n_layers: int, pp: int, pp_rank: int, virtual_stages: int = 1) -> list[range]:
    """The layers of pipeline rank ``pp_rank`` as its ``virtual_stages`` model chunks, in order.
    With one, ``[layer_range(...)]``. With ``v`` (interleaved 1F1B, Megatron's layout) the model
    is cut into ``pp * v`` equal chunks and chunk ``c`` of rank ``s`` is model chunk ``c * pp + s``
    (``n_layers`` must divide evenly)::

        n_layers 8, pp 2, v 2:   rank 0: [0, 1] [4, 5]    rank 1: [2, 3] [6, 7]
    """
    if virtual_stages == 1:
        return [layer_range(n_layers, pp, pp_rank)]
    n = pp * virtual_stages
    if n_layers % n:
        raise ValueError(f"model.n_layers={n_layers} is not divisible by parallel.pp * "
                         f"parallel.virtual_stages = {pp} * {virtual_stages} (equal model chunks)")
    size = n_layers // n
    return [range((c * pp + pp_rank) * size, (c * pp + pp_rank + 1) * size)
            for c in range(virtual_stages)]


@dataclass(frozen=True)
class Topology:
    """One rank's view of one generation."""

    dims: ParallelDims
    rank: int
    generation: int
    buddy_policy: str = "ring_over_nodes"
    replicas: int = 1  # ft.replicas: how many buddies hold each rank's replica

    @property
    def coords(self) -> dict[str, int]:
        return self.dims.coords(self.rank)

    def buddies(self, rank: int | None = None) -> tuple[int, ...]:
        """The ``replicas`` ranks that hold ``rank``'s replica, the preferred one first
        (``deadpool.policies``; a policy sees the layout's coordinates and nodes)."""
        table = buddies_table(self.dims, self.buddy_policy, self.replicas)
        return table[self.rank if rank is None else rank]

    def buddy(self, rank: int | None = None) -> int:
        """The first of ``buddies``."""
        return self.buddies(rank)[0]

    def wards(self) -> tuple[int, ...]:
        """The ranks whose replicas this rank holds (``wards()[j]``: whose j-th buddy it is)."""
        return wards_table(self.dims, self.buddy_policy, self.replicas)[self.rank]

    def ward(self) -> int:
        """The first of ``wards`` (the inverse of ``buddy``: a permutation)."""
        return self.wards()[0]


def node_slots(cfg: dict, node: int) -> list[int]:
    """The launch slots of ``node``: ``ranks_per_node`` consecutive slots (the spares after the
    ranks, on nodes of their own once the ranks' nodes are full). Every launcher lays a job's
    processes out so (one node agent per node, or srun's block distribution)."""
    dims = ParallelDims.from_config(cfg["parallel"])
    n = dims.world_size + int(cfg["ft"]["num_spares"])
    rpn = dims.ranks_per_node
    return [s for s in range(node * rpn, min(n, (node + 1) * rpn))]


def num_nodes(cfg: dict) -> int:
    """How many nodes ``node_slots`` fills: the ranks and the spares, ``ranks_per_node`` each."""
    dims = ParallelDims.from_config(cfg["parallel"])
    n = dims.world_size + int(cfg["ft"]["num_spares"])
    return -(-n // dims.ranks_per_node)


def repl_name(direction: str, j: int) -> str:
    """The name of the replication group to the j-th buddy (``out``) or from the j-th ward
    (``in``): ``repl_out``, ``repl_out1``, ... (the first keeps the name it had with one buddy)."""
    return f"repl_{direction}" + (str(j) if j else "")
