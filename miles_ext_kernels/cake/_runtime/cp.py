"""Context parallelism (CP): which pieces of which documents each rank holds, the one collective the ops call, and a
driver that runs W ranks' stages in one process.

A packed stream of documents (`cu_seqlens_global`) is cut over the W ranks of a group:
- `contiguous`: rank r holds tokens [r T / W, (r + 1) T / W) (fla's layout; T % W == 0);
- `zigzag`: Megatron's THD layout: each document is cut in 2W equal chunks and rank r holds chunks r and 2W - 1 - r
  of every document, documents in order (each document's length a multiple of 2W).
A *piece* is the non-empty part of one document on one rank; a rank's pieces, in its token order, are its local
documents (`CPContext.cu_seqlens`). A piece with a predecessor (an earlier piece of its document, on any rank)
*imports* state; a piece with a successor *exports* it. Under zigzag rank W - 1's two chunks of a document are
adjacent and form one piece. The ops exchange fixed-size per-rank buffers (a number of `all_gather`s per layer call
fixed by the plan: conv1d one per direction, gdn / kda `state_exchanges` per pass; sized by states / halos and the
plan, never by T) and read the gathered buffers through the index tables of the plan, built here once per step on
the host.

Recurrent ops (gdn, kda) chain their states: piece p's incoming state is the fold over its document's earlier
pieces q (in order) of S <- M_q S + E_q, with E_q the state q ends in from a zero state and M_q its transition; the
gradient goes the other way (G <- M_q^T G + D_q over the later pieces, D_q being the state gradient q's start gets
from a zero end gradient). A piece in a document's middle may instead wait for its true incoming state (the plan's
schedule: `Piece.waits`, `fwd_round`, `bwd_round`), which saves its extra state pass at the cost of one more
exchange. conv1d reads a halo: the last W_conv - 1 inputs of a document before a piece.

`run_simulated` runs the stages of W ranks in one process (the GPU tests and `bench/cp.py` on one GPU); a process
group runs them over torch.distributed (NCCL on GPUs, gloo for CPU tensors).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Piece:
    doc: int          # document index in cu_seqlens_global
    index: int        # position among the document's non-empty pieces
    count: int        # number of non-empty pieces of the document
    rank: int
    seg: int          # local document index on its rank
    start: int        # global token range [start, end)
    end: int

    waits: bool = False   # a middle piece that waits for its true incoming state (no extra state pass)
    fwd_round: int = 0    # the state exchange after which its incoming state is known (0: it imports none)
    bwd_round: int = 0    # the backward's exchange after which its end-state gradient is known (0: it exports none)

    @property
    def imports(self) -> bool:
        return self.index > 0

    @property
    def exports(self) -> bool:
        return self.index < self.count - 1

    @property
    def fwd_send(self) -> int:
        """The forward exchange that carries its export (0: none): a document's first piece and a waiting piece send
        their true final state E one exchange after their incoming state is known; the other middle pieces send
        (E, M) in the exchange that completes their own incoming state."""
        if not self.exports:
            return 0
        return self.fwd_round + 1 if self.index == 0 or self.waits else self.fwd_round

    @property
    def bwd_send(self) -> int:
        """The backward exchange that carries D, the gradient of its start state (0: it imports none); the mirror of
        `fwd_send` (a document's last piece and a waiting piece send the true gradient)."""
        if not self.imports:
            return 0
        return self.bwd_round + 1 if self.index == self.count - 1 or self.waits else self.bwd_round


def _int_list(name: str, cu) -> list:
    if isinstance(cu, torch.Tensor):
        if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int32 / int64 tensor, got {cu.dtype} with shape "
                            f"{tuple(cu.shape)}")
        return [int(x) for x in cu.detach().to("cpu").tolist()]
    if isinstance(cu, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in cu):
        return list(cu)
    raise TypeError(f"{name} must be a 1-D int32 / int64 tensor or a list of ints, got {type(cu).__name__}")


def default_state_exchanges(layout: str) -> int:
    """Zigzag: 2 (rank W - 1's piece of each document's middle waits for its true state instead of running the
    extra state pass); contiguous: 1 (no piece waits)."""
    return 2 if layout == "zigzag" else 1


def _check_exchanges(state_exchanges, layout: str) -> int:
    if state_exchanges is None:
        return default_state_exchanges(layout)
    if isinstance(state_exchanges, bool) or not isinstance(state_exchanges, int) or state_exchanges < 1:
        raise ValueError(f"state_exchanges must be a positive int or None, got {state_exchanges!r}")
    return state_exchanges


def _schedule(lens: list, exchanges: int) -> tuple:
    """(waits, fwd_round, bwd_round) per piece of one document (piece lengths `lens`, in order): up to exchanges - 1
    middle pieces wait, the longest first (ties: the later piece). Between waiting pieces (and the document's ends)
    the pieces run the extra state pass; the forward's k-th exchange completes the incoming states of the pieces
    after the (k - 1)-th waiting piece up to the k-th, the backward's the mirror image."""
    n = len(lens)
    middle = set(sorted(range(1, n - 1), key=lambda i: (-lens[i], -i))[:exchanges - 1]) if exchanges > 1 else set()
    waits = [i in middle for i in range(n)]
    fwd, bwd = [0] * n, [0] * n
    seen = 0  # anchors before i: piece 0 and the waiting pieces
    for i in range(n):
        fwd[i] = seen
        seen += i == 0 or waits[i]
    seen = 0  # anchors after i: the last piece and the waiting pieces
    for i in range(n - 1, -1, -1):
        bwd[i] = seen
        seen += i == n - 1 or waits[i]
    return waits, fwd, bwd


def plan(cu_seqlens_global, world: int, layout: str = "contiguous", state_exchanges=None) -> tuple[list, int]:
    """(pieces of every rank: a list per rank, in local token order; total tokens T). Checks the layout's rules.
    `state_exchanges`: the gdn / kda state exchanges per pass (None: `default_state_exchanges`); with E of them up to
    E - 1 middle pieces of each document wait for their true incoming state instead of running the extra pass."""
    cu = _int_list("cu_seqlens_global", cu_seqlens_global)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"the CP group size must be a positive int, got {world!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    exchanges = _check_exchanges(state_exchanges, layout)
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens_global must rise from 0 with at least 2 entries, got {cu[:8]}...")
    T = cu[-1]
    spans: list = [[] for _ in range(world)]  # per rank: (doc, start, end) in local order
    if layout == "contiguous":
        if T % world != 0:
            raise ValueError(f"layout='contiguous' needs the token count T={T} to be a multiple of the CP size "
                             f"{world}")
        share = T // world
        for r in range(world):
            lo_r, hi_r = r * share, (r + 1) * share
            for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
                lo, hi = max(a, lo_r), min(b, hi_r)
                if hi > lo:
                    spans[r].append((d, lo, hi))
    else:
        for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            if (b - a) % (2 * world) != 0:
                raise ValueError(f"layout='zigzag' needs every document's length to be a multiple of 2 x CP size = "
                                 f"{2 * world}; document {d} has {b - a} tokens")
            c = (b - a) // (2 * world)
            if c == 0:
                continue
            for r in range(world - 1):
                for p in (r, 2 * world - 1 - r):
                    spans[r].append((d, a + p * c, a + (p + 1) * c))
            # rank W - 1's two chunks are adjacent: one piece
            spans[world - 1].append((d, a + (world - 1) * c, a + (world + 1) * c))
    # order each document's pieces by their global start: that is the recurrence's order
    by_doc: dict = {}
    for r, lst in enumerate(spans):
        for s, (d, lo, hi) in enumerate(lst):
            by_doc.setdefault(d, []).append((lo, hi, r, s))
    pieces: list = [[None] * len(lst) for lst in spans]
    for d, lst in by_doc.items():
        lst.sort()
        waits, fwd, bwd = _schedule([hi - lo for lo, hi, _, _ in lst], exchanges)
        for i, (lo, hi, r, s) in enumerate(lst):
            pieces[r][s] = Piece(d, i, len(lst), r, s, lo, hi, waits[i], fwd[i], bwd[i])
    return pieces, T


class Comm:
    """The one collective the ops need: `all_gather(x)` -> [W, *x.shape], rank order."""

    def __init__(self, group):
        import torch.distributed as dist

        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._nccl = dist.get_backend(group) == "nccl"

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        x = x.contiguous()
        out = x.new_empty((self.world,) + tuple(x.shape))
        if self._nccl:
            dist.all_gather_into_tensor(out, x, group=self.group)
        else:
            dist.all_gather(list(out.unbind(0)), x, group=self.group)
        return out


@dataclass
class CPContext:
    """One rank's view of a CP plan (built once per step by `build_cp_context`; read by every layer's call).

    cu_seqlens    int32 [n_local + 1] on the device: the rank's pieces as local documents
    num_tokens    the rank's token count
    pieces        this rank's pieces (host), `all_pieces` every rank's
    n_export / n_import   how many of the rank's pieces another piece reads / read another piece (conv1d's
                  halo exchange: its gathered buffers hold `max_export` / `max_import` slots per rank)
    state_exchanges   the gdn / kda state exchanges per pass (`state_round` / `grad_round`); exchange k's gathered
                  buffers hold `max_fwd_send[k - 1]` / `max_bwd_send[k - 1]` slots per rank
    """
    layout: str
    world: int
    rank: int
    comm: Optional[Comm]
    device: torch.device
    all_pieces: list
    total_tokens: int
    conv1d_kernel_size: Optional[int] = None
    cu_seqlens: torch.Tensor = field(init=False)
    _cache: dict = field(init=False, default_factory=dict)

    def __post_init__(self):
        if self.device.type == "cuda" and self.device.index is None:  # compare equal to the tensors' "cuda:i"
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pieces = self.all_pieces[self.rank]
        cu = [0]
        for p in self.pieces:
            cu.append(cu[-1] + p.end - p.start)
        self.num_tokens = cu[-1]
        self.cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=self.device)
        self.export_slots = [[p.seg for p in lst if p.exports] for lst in self.all_pieces]
        self.import_slots = [[p.seg for p in lst if p.imports] for lst in self.all_pieces]
        self.max_export = max(1, max(len(x) for x in self.export_slots))
        self.max_import = max(1, max(len(x) for x in self.import_slots))
        every = [p for lst in self.all_pieces for p in lst]
        self.state_exchanges = max([1] + [p.fwd_send for p in every] + [p.bwd_send for p in every])
        # per exchange and rank: the local documents that send in it, in local order
        self.fwd_sends = [[[p.seg for p in lst if p.fwd_send == k] for lst in self.all_pieces]
                          for k in range(1, self.state_exchanges + 1)]
        self.bwd_sends = [[[p.seg for p in lst if p.bwd_send == k] for lst in self.all_pieces]
                          for k in range(1, self.state_exchanges + 1)]
        self.max_fwd_send = [max(1, max(len(x) for x in rnd)) for rnd in self.fwd_sends]
        self.max_bwd_send = [max(1, max(len(x) for x in rnd)) for rnd in self.bwd_sends]
        # host lookups the tables below make per piece (a plan may hold thousands of documents)
        self._by_doc: dict = {}
        for p in sorted(every, key=lambda p: (p.doc, p.index)):
            self._by_doc.setdefault(p.doc, []).append(p)

        def positions(lists):
            return [{seg: i for i, seg in enumerate(lst)} for lst in lists]

        self._export_pos, self._import_pos = positions(self.export_slots), positions(self.import_slots)
        self._fwd_pos = [positions(rnd) for rnd in self.fwd_sends]
        self._bwd_pos = [positions(rnd) for rnd in self.bwd_sends]

    # ------------------------------------------------------------------------------------------------ tables
    def _tensor(self, key, rows, dtype=torch.int64):
        if key not in self._cache:
            self._cache[key] = torch.tensor(rows, dtype=dtype, device=self.device)
        return self._cache[key]

    def _doc_pieces(self, doc: int) -> list:
        return self._by_doc[doc]

    @property
    def export_segs(self) -> torch.Tensor:
        """int64 [n_export]: local documents whose end another piece reads (conv1d's halo)."""
        return self._tensor("export", self.export_slots[self.rank])

    @property
    def import_segs(self) -> torch.Tensor:
        """int64 [n_import]: local documents that read another piece's end (conv1d's halo)."""
        return self._tensor("import", self.import_slots[self.rank])

    @property
    def n_export(self) -> int:
        return len(self.export_slots[self.rank])

    @property
    def n_import(self) -> int:
        return len(self.import_slots[self.rank])

    # ------------------------------------------------------------------------------ gdn / kda state exchanges
    def _send_slot(self, p: Piece, k: int, fwd: bool) -> int:
        """Flat index of piece p's slot in exchange k's gathered [W, max_send, ...] buffer."""
        pos, width = (self._fwd_pos, self.max_fwd_send) if fwd else (self._bwd_pos, self.max_bwd_send)
        return p.rank * width[k - 1] + pos[k - 1][p.rank][p.seg]

    def _state_chain(self, p: Piece) -> list:
        """The pieces whose (E, M) fold into piece p's incoming state, in recurrence order: its document's earlier
        pieces from the last one that sends a true state."""
        chain = self._doc_pieces(p.doc)[:p.index]
        first = max(i for i, q in enumerate(chain) if q.index == 0 or q.waits)
        return chain[first:]

    def _grad_chain(self, p: Piece) -> list:
        """The pieces whose D folds into piece p's end-state gradient: the later pieces of its document up to the
        first one that sends a true gradient, that one first."""
        chain = self._doc_pieces(p.doc)[p.index + 1:]
        last = min(i for i, q in enumerate(chain) if q.index == q.count - 1 or q.waits)
        return chain[:last + 1][::-1]

    def _kept_m(self) -> dict:
        """{(forward exchange, flat slot): row} of the M the backward's chains read, rows in (exchange, slot)
        order: the forward keeps only these of its gathered buffers (their last K columns) for the backward."""
        if "kept_m" not in self._cache:
            need = sorted({(q.fwd_send, self._send_slot(q, q.fwd_send, True))
                           for p in self.pieces if p.exports for q in self._grad_chain(p)[1:]})
            self._cache["kept_m"] = {key: row for row, key in enumerate(need)}
        return self._cache["kept_m"]

    def _round(self, k: int, fwd: bool) -> dict:
        key = ("round", k, fwd)
        if key in self._cache:
            return self._cache[key]
        sends = (self.fwd_sends if fwd else self.bwd_sends)[k - 1][self.rank]
        own, extra = [], []
        for pos, seg in enumerate(sends):
            p = self.pieces[seg]
            end = p.index == 0 if fwd else p.index == p.count - 1
            (own if end or p.waits else extra).append((pos, seg))
        rows, dest = [], []
        for p in self.pieces:
            if (p.fwd_round if fwd else p.bwd_round) != k:
                continue
            if fwd:  # the earlier pieces from the last one that sends a true state, in recurrence order
                rows.append([(self._send_slot(q, k, True), -1 if i == 0 else self._send_slot(q, k, True))
                             for i, q in enumerate(self._state_chain(p))])
            else:    # the later pieces from the first one that sends a true gradient, back to p
                kept = self._kept_m()
                rows.append([(self._send_slot(q, k, False),
                              -1 if i == 0 else kept[(q.fwd_send, self._send_slot(q, q.fwd_send, True))])
                             for i, q in enumerate(self._grad_chain(p))])
            dest.append(p.seg)

        def t(xs):
            return torch.tensor(xs, dtype=torch.int64, device=self.device)

        out = {"own_pos": t([x for x, _ in own]), "own_segs": t([x for _, x in own]),
               "extra_pos": t([x for x, _ in extra]), "extra_segs": t([x for _, x in extra]),
               "chain": _padded(rows, self.device), "dest": t(dest)}
        if fwd:
            out["keep"] = t([slot for (x, slot) in self._kept_m() if x == k])
        self._cache[key] = out
        return out

    def state_round(self, k: int) -> dict:
        """This rank's part of the forward's exchange k (1 .. state_exchanges), int64 tensors:
        own_segs / own_pos   the local documents whose own pass (from their incoming state, known by now; a
                             document's first piece from zero) gives the true final state E they send in this
                             exchange, and their slots in the rank's [max_fwd_send[k - 1], ...] buffer;
        extra_segs / extra_pos   those that send (E, M) from the extra state pass;
        chain [n, L, 2], dest [n]   per local document whose incoming state this exchange completes, the (E, M)
                             flat slots of the exchange's gathered buffer in recurrence order, starting from the
                             last earlier piece that sent a true state (M = -1): S <- M S + E from S = 0;
        keep [F_k]           the flat slots of the exchange's gathered buffer whose M this rank's backward reads
                             (kept, in exchange then slot order: the rows `grad_round`'s M slots index)."""
        return self._round(k, True)

    def grad_round(self, k: int) -> dict:
        """The backward's exchange k, the mirror of `state_round`: own_* the pieces whose own reverse pass (from
        their end-state gradient, known by now; a document's last piece from zero) gives the true gradient D of
        their start state, extra_* those whose D comes from the extra reverse pass, and per local document whose
        end-state gradient this exchange completes, the (D slot in this exchange's gathered buffer, row of the M the
        forward kept, `state_round`'s "keep") of the later pieces from the first one that sent a true gradient
        (M = -1) back: G <- M^T G + D from G = 0."""
        return self._round(k, False)

    def halo_tables(self, width: int) -> dict:
        """Index tables of conv1d's halo exchange at kernel width `width` (R = width - 1 rows per piece):
        export  int64 [max_export, R]: the local rows each exporting piece sends (its last R; -1: before the piece);
        state   int64 [n_local, width]: per local document, the flat row of the gathered [W * max_export * R] buffer
                that entry j of its initial state reads (x[start - (width - j)]), -1 for zeros (entry 0, rows before
                the document, pieces without a predecessor);
        grad    int64 [max_export * R, L]: per exported row, the flat rows of the gathered [W * max_import * R]
                state-gradient buffer that read it (-1 pads), summed in this order;
        rows    int64 [n_rows], slots int64 [n_rows]: the local rows that receive those sums and their exported-row
                index (the exported rows that lie in their piece)."""
        key = ("halo", width)
        if key in self._cache:
            return self._cache[key]
        R = width - 1
        loc, off = [], 0  # local start row of each of this rank's pieces
        for p in self.pieces:
            loc.append(off)
            off += p.end - p.start
        export = [[-1] * R for _ in range(self.max_export)]
        for e, seg in enumerate(self.export_slots[self.rank]):
            p = self.pieces[seg]
            for r in range(R):
                g = p.end - R + r
                if g >= p.start:
                    export[e][r] = loc[seg] + g - p.start
        state = [[-1] * width for _ in self.pieces]
        users: dict = {}  # (rank, export slot, r) -> [flat gathered state-gradient rows], in (rank, slot, k) order
        me = self.rank
        for doc in self._by_doc.values():  # a document's pieces tile it in order
            for idx in range(1, len(doc)):
                p, prev = doc[idx], doc[idx - 1]
                if p.rank != me and prev.rank != me and prev.end - prev.start >= R:
                    continue  # its halo lies in one piece of another rank: nothing of this rank's tables
                i = self._import_pos[p.rank][p.seg]
                j = idx - 1
                for k in range(1, width):  # entry width - k reads token p.start - k, walking back over the pieces
                    pos = p.start - k
                    while j >= 0 and pos < doc[j].start:
                        j -= 1
                    if j < 0:
                        break
                    q = doc[j]
                    r = pos - (q.end - R)
                    e = self._export_pos[q.rank][q.seg]
                    if p.rank == me:
                        state[p.seg][width - k] = (q.rank * self.max_export + e) * R + r
                    if q.rank == me:
                        users.setdefault((q.rank, e, r), []).append((p.rank * self.max_import + i) * R + (k - 1))
        grad = [[] for _ in range(self.max_export * R)]
        rows, slots = [], []
        for e, seg in enumerate(self.export_slots[self.rank]):
            for r in range(R):
                grad[e * R + r] = sorted(users.get((self.rank, e, r), []))
                if export[e][r] >= 0:
                    rows.append(export[e][r])
                    slots.append(e * R + r)
        L = max([len(x) for x in grad] + [1])
        grad = [x + [-1] * (L - len(x)) for x in grad]
        t = {"export": export, "state": state, "grad": grad, "rows": rows, "slots": slots}
        out = {n: torch.tensor(v, dtype=torch.int64).reshape(-1, width if n == "state" else R if n == "export" else L)
               if n in ("export", "state", "grad") else torch.tensor(v, dtype=torch.int64)
               for n, v in t.items()}
        out = {n: v.to(self.device) for n, v in out.items()}
        self._cache[key] = out
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            raise RuntimeError("this CP context has no process group (a simulated rank): run its stages with "
                               "cake._runtime.cp.run_simulated")
        return self.comm.all_gather(x)


def check_call(op: str, cp, name: str, x, *, token_dim: int, given=(), unserved=()) -> None:
    """The rules of an op's call with `cp_context` (ValueError / TypeError naming the argument, before any launch):
    cp a CPContext; the arguments the context supplies (`given`: (name, value) pairs) and those CP does not serve
    (`unserved`) left None / False; x (argument `name`) the rank's tokens along `token_dim` (B = 1 before it), on the
    context's device."""
    if not isinstance(cp, CPContext):
        raise TypeError(f"{op}: cp_context must come from cake.build_cp_context, got {type(cp).__name__}")
    for arg, value in given:
        if value is not None:
            also = [n for n, _ in given]
            rest = f": pass neither {' nor '.join(also)}" if len(also) > 1 else ""
            raise ValueError(f"{op}: pass {arg} or cp_context, not both (the context holds the rank's documents"
                             f"{rest})")
    for arg, value in unserved:
        if value is not None and value is not False:
            raise ValueError(f"{op}: {arg} is not served with cp_context")
    if isinstance(x, torch.Tensor):
        want = (1,) * token_dim + (cp.num_tokens,)
        if x.dim() <= token_dim or tuple(x.shape[:token_dim + 1]) != want:
            raise ValueError(f"{op}: with cp_context {name} must be [{', '.join(map(str, want))}, ...] (this rank's "
                             f"tokens), got {tuple(x.shape)}")
        if x.device != cp.device:
            raise ValueError(f"{op}: cp_context was built for {cp.device}, {name} is on {x.device}")


def _padded(rows: list, device) -> torch.Tensor:
    L = max([len(r) for r in rows] + [1])
    out = torch.full((len(rows), L, 2), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)


def _check_kernel_size(conv1d_kernel_size):
    if conv1d_kernel_size is None:
        return None
    if isinstance(conv1d_kernel_size, bool) or not isinstance(conv1d_kernel_size, int) or conv1d_kernel_size < 1:
        raise ValueError(f"conv1d_kernel_size must be a positive int or None, got {conv1d_kernel_size!r}")
    return conv1d_kernel_size


def build_cp_context(cu_seqlens_global, group, *, conv1d_kernel_size: Optional[int] = None,
                     layout: str = "contiguous", state_exchanges: Optional[int] = None, device=None) -> CPContext:
    """See `miles_ext_kernels.cake.build_cp_context`."""
    import torch.distributed as dist

    if group is None or not dist.is_available() or not dist.is_initialized():
        raise ValueError("group must be a torch.distributed process group (init_process_group first); for W "
                         "simulated ranks in one process use cake._runtime.cp.simulated_contexts")
    comm = Comm(group)
    pieces, T = plan(cu_seqlens_global, comm.world, layout, state_exchanges)
    if device is None:
        device = (cu_seqlens_global.device if isinstance(cu_seqlens_global, torch.Tensor)
                  and cu_seqlens_global.device.type != "cpu" else
                  torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
                  else torch.device("cpu"))
    return CPContext(layout, comm.world, comm.rank, comm, torch.device(device), pieces, T,
                     _check_kernel_size(conv1d_kernel_size))


def simulated_contexts(cu_seqlens_global, world: int, *, layout: str = "contiguous",
                       conv1d_kernel_size: Optional[int] = None, state_exchanges: Optional[int] = None,
                       device="cpu") -> list:
    """The W contexts of a plan, without a process group (for `run_simulated`)."""
    pieces, T = plan(cu_seqlens_global, world, layout, state_exchanges)
    return [CPContext(layout, world, r, None, torch.device(device), pieces, T, _check_kernel_size(conv1d_kernel_size))
            for r in range(world)]


def shard(x: torch.Tensor, ctx: CPContext, dim: int = 1) -> torch.Tensor:
    """Rank ctx.rank's tokens of a whole-stream tensor (along `dim`), in its local order: for tests and benchmarks
    (a real run gets its shard from the data pipeline)."""
    parts = [x.narrow(dim, p.start, p.end - p.start) for p in ctx.pieces]
    if not parts:
        return x.narrow(dim, 0, 0)
    return torch.cat(parts, dim)


def unshard(parts: list, contexts: list, dim: int = 1) -> torch.Tensor:
    """The whole-stream tensor from every rank's local tensor (inverse of `shard`)."""
    chunks = []
    for c, x in zip(contexts, parts):
        off = 0
        for p in c.pieces:
            chunks.append((p.start, x.narrow(dim, off, p.end - p.start)))
            off += p.end - p.start
    chunks.sort(key=lambda t: t[0])
    return torch.cat([t for _, t in chunks], dim)


# ---------------------------------------------------------------------------------------------------- stages
# An op's CP pass is a generator per rank: it yields the buffer it contributes to an all_gather and receives the
# gathered [W, ...] buffer back (any number of rounds, the same on every rank); its return value is its result.
def run_rank(stage, ctx: CPContext):
    """Run one rank's stage generator over its context's process group."""
    try:
        buf = next(stage)
        while True:
            buf = stage.send(ctx.all_gather(buf))
    except StopIteration as done:
        return done.value


def run_simulated(stages: list) -> list:
    """Run W ranks' stage generators in lockstep in one process: each round stacks the ranks' buffers in rank order
    (what all_gather would give every rank) and sends the stack to each. Returns the ranks' results."""
    results: list = [None] * len(stages)
    live = list(range(len(stages)))
    bufs: dict = {}
    for r in live:
        try:
            bufs[r] = next(stages[r])
        except StopIteration as done:
            results[r] = done.value
    live = [r for r in live if r in bufs]
    while live:
        if len(live) != len(stages):
            raise RuntimeError("simulated CP ranks disagree on their number of collectives")
        gathered = torch.stack([bufs[r] for r in live])
        nxt: dict = {}
        for r in live:
            try:
                nxt[r] = stages[r].send(gathered)
            except StopIteration as done:
                results[r] = done.value
        bufs = nxt
        live = [r for r in live if r in bufs]
    return results


def stage_function(forward: Callable, backward: Callable):
    """An autograd.Function whose forward and backward are CP stage generators run over the context's group.
    forward(ctx_cp, *tensors) -> (outputs tuple, saved); backward(ctx_cp, saved, *grads) -> input grads tuple."""
    class _CP(torch.autograd.Function):
        @staticmethod
        def forward(fctx, cp_ctx, *args):
            outs, saved = run_rank(forward(cp_ctx, *args), cp_ctx)
            fctx.cp_ctx, fctx.saved = cp_ctx, saved
            return outs

        @staticmethod
        def backward(fctx, *grads):
            grads_in = run_rank(backward(fctx.cp_ctx, fctx.saved, *grads), fctx.cp_ctx)
            fctx.saved = None
            return (None,) + tuple(grads_in)

    return _CP


def simulate(forward, backward, contexts: list, tensors: list, params: list = (), args: tuple = (), grad_out=None,
             token_dim: int = 1):
    """An op's CP pass over W simulated ranks on whole-stream tensors: `tensors` are sharded (along token_dim),
    `params` given whole to every rank, then forward(ctx, *shards, *params, *args) per rank. Returns (output, grads):
    whole-stream output; with `grad_out`, the gradients of `tensors` (unsharded) then of `params` (the ranks'
    partials summed in rank order, as the caller's all-reduce would), None where a stage returned None."""
    fw = run_simulated([forward(c, *[shard(t, c, token_dim) for t in tensors], *params, *args) for c in contexts])
    out = unshard([r[0] for r in fw], contexts, token_dim)
    if grad_out is None:
        return out, None
    bw = run_simulated([backward(c, r[1], shard(grad_out, c, token_dim)) for c, r in zip(contexts, fw)])
    grads = []
    for i in range(len(tensors) + len(params)):
        parts = [b[i] for b in bw]
        if any(p is None for p in parts):
            grads.append(None)
        elif i < len(tensors):
            grads.append(unshard(parts, contexts, token_dim))
        else:
            total = parts[0].clone()
            for p in parts[1:]:
                total += p
            grads.append(total)
    return out, grads
