"""Many sessions, one step: the runner of a batched artifact (design section 10).

One :class:`BatchedRunner` owns, for one loaded program, everything the sessions share: the K/V
pools (allocated once, so the addresses a captured CUDA graph holds never move), the page
allocator, the session slots, and fixed-address device buffers for the step's inputs. A step
(:meth:`BatchedRunner.step`) takes the next tokens of any subset of the open sessions, packs them
along the token axis in the order given, and:

  1. admits: every session open, its tokens inside the vocabulary and its length within
     ``max_capacity``, the step within ``max_write`` tokens, and pages for every flat row the step
     writes, taken from the pool all or nothing (:class:`PoolExhausted` names the pool's size);
  2. fills the batch inputs on the host (positions, slots, rows by ``paged_row``, page tables,
     lengths) and copies them into the device buffers: the runtime never reads a device tensor;
  3. runs the program (a captured graph per padded width and method when ``cuda_graphs``): a
     decode step of several sessions (one token each) by the sessions method where the package
     has one, any other step by the general method (width 1: the decode method);
  4. commits every session's length only if the run returned: a failed step commits nothing for
     anyone and gives back the pages it took.

Which tokens a step carries (decode first, then prefill chunks, up to a budget) is the caller's
choice: :func:`offgraph_export.generate.generate_batch` is one such scheduler.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, Field

from offgraph_export.errors import OffgraphError, StepFailed, StepRefused, first_line
from offgraph_export.runtime.admission import positions_suppliable
from offgraph_export.runtime.program import LoadedProgram
from offgraph_export.runtime.session import Exclusive
from offgraph_export.runtime.storage import Allocator, check_disjoint, default_allocator
from offgraph_export.specs.artifact import STEP_METHOD
from offgraph_export.specs.manifest import BATCH_INPUTS, paged_row, pages_for

__all__ = ["BatchedRunner", "BatchMetrics", "PoolExhausted", "graph_widths"]


class PoolExhausted(StepRefused):
    """The page pool cannot hold the step's new rows (nothing was taken or changed)."""


def graph_widths(max_write: int) -> list[int]:
    """The padded widths CUDA graphs are captured at: powers of two up to ``max_write``, and
    ``max_write`` itself."""
    widths = [1 << i for i in range(max_write.bit_length()) if 1 << i <= max_write]
    return widths if widths[-1] == max_write else [*widths, max_write]


class BatchMetrics(BaseModel):
    sessions: int
    steps: int
    failed_steps: int
    refused_steps: int
    pool_pages: int
    free_pages: int
    #: bytes of every pool and ring tensor
    allocated_bytes: int
    #: bytes of the rows the open sessions' histories hold
    live_bytes: int
    graph_captures: int = 0
    graph_replays: int = 0
    #: steps padded with scratch tokens (to a captured width)
    padded_tokens: int = 0
    #: steps launched per compiled method (the decode steps of several sessions: ``sessions``)
    method_steps: dict[str, int] = Field(default_factory=dict)


@dataclass
class _Session:
    slot: int
    length: int = 0
    pages: list[int] = field(default_factory=list)
    #: how many of its pages the device's page table row holds
    table_rows: int = 0


@dataclass
class _Staging:
    """One width's ``[2, row]`` views of the runner's token buffers: device, and a numpy view of
    the host's (pinned on cuda; a numpy store costs ~0.1 us, a tensor ``__setitem__`` ~5)."""

    dev_long: torch.Tensor  # tokens, positions
    np_long: object
    dev_int: torch.Tensor  # slots, rows
    np_int: object
    #: the program's inputs for this width (views of the fixed buffers, the storage): made once
    inputs: list[torch.Tensor] = field(default_factory=list)


class _StepGraph:
    """One captured step of a padded width over the runner's fixed buffers."""

    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: list[torch.Tensor]) -> None:
        self.graph = graph
        self.outputs = outputs


def _aligned(n: int) -> int:
    return -(-n // 4) * 4  # rows of the staging buffers stay 16-byte aligned


class BatchedRunner:
    """Sessions over one batched program. ``pool_pages``: the pool's size in pages (the scratch
    page included; default the program's ``paging.pool_pages``); ``poison``: every unwritten row
    NaN (check mode)."""

    def __init__(
        self,
        program: LoadedProgram,
        pool_pages: int | None = None,
        allocator: Allocator = default_allocator,
        poison: bool = False,
        cuda_graphs: bool = False,
    ) -> None:
        specs = program.specs
        manifest = specs.manifest
        paging = manifest.paging
        if paging is None:
            raise OffgraphError(f"{program.path} serves one session per program; export it with --max-sessions for a batched runner")
        tokens_inputs = [i for i, s in enumerate(specs.inputs) if s.index_bound is not None]
        if len(specs.inputs) != 2 or len(tokens_inputs) != 1 or not positions_suppliable(specs):
            raise OffgraphError(
                f"{program.path}: a batched program takes the token ids and the positions only (the runtime "
                f"supplies the positions); its inputs are {[s.name for s in specs.inputs]}"
            )
        self.program = program
        self.specs = specs
        self.manifest = manifest
        self.paging = paging
        self.device = program.device
        self.vocab = int(specs.inputs[tokens_inputs[0]].index_bound)  # type: ignore[arg-type]
        self._tokens_index = tokens_inputs[0]
        self._positions_index = specs.positions_input
        pages = paging.pool_pages if pool_pages is None else pool_pages
        if isinstance(pages, bool) or not isinstance(pages, int) or not 2 <= pages <= paging.max_pool_pages:
            raise OffgraphError(f"pool_pages={pool_pages!r} must be an int in [2, {paging.max_pool_pages}] (the scratch page included)")
        self.pool_pages = pages
        self.poison = poison
        self._flat = manifest.has_flat  # a property over the layers: read once
        dtype = getattr(torch, manifest.storage_dtype)
        self.storage: list[torch.Tensor] = []
        for s in manifest.storage_inputs():
            shape = manifest.storage_shape(s, pages)
            tensor = allocator(shape, dtype, self.device)
            if tuple(tensor.shape) != shape or tensor.dtype != dtype or tensor.device != self.device or not tensor.is_contiguous():
                raise OffgraphError(f"allocator returned {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}; expected contiguous {shape} {dtype} on {self.device}")
            tensor.fill_(float("nan") if poison else 0)
            self.storage.append(tensor)
        check_disjoint(self.storage)
        #: (bytes of one token's row, rows it keeps at most: None for flat) per storage input
        self._row_bytes = [
            (t.element_size() * (t.shape[2] * t.shape[3] if layer.window is None else t.shape[1] * t.shape[3]),
             None if layer.window is None else manifest.rows(layer, manifest.max_capacity))
            for t, s in zip(self.storage, manifest.storage_inputs())
            for layer in [manifest.owner(s)[0]]
        ]
        self._free_pages = list(range(pages - 1, 0, -1))  # a stack; page 0 is the scratch page
        self._free_slots = list(range(paging.max_sessions, 0, -1))
        self._sessions: dict[int, _Session] = {}
        self._ids = itertools.count()
        width = _aligned(manifest.max_write)
        # fixed-address device buffers (views of them are the program's inputs) and host mirrors,
        # one byte buffer each side so that a step's inputs are one copy (each copy_ launched from
        # Python costs the step about 15 us of host time on the H100 machine, the GPU waiting):
        # tokens and positions (int64), then slots and rows (int32), flat regions whose first
        # 2 * row entries, viewed [2, row], are a step of width w's (row: w rounded up to 4: views
        # contiguous on both sides), then the sessions' lengths (int32). Every region starts
        # 16-byte aligned, as compiled kernels assume.
        long_bytes, int_bytes = 2 * width * 8, 2 * width * 4
        staged_bytes = long_bytes + int_bytes + _aligned(paging.slots) * 4
        pin = self.device.type == "cuda"
        self._dev_staged = torch.zeros(staged_bytes, dtype=torch.uint8, device=self.device)
        self._host_staged = torch.zeros(staged_bytes, dtype=torch.uint8, pin_memory=pin)

        def regions(buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            lengths = long_bytes + int_bytes
            return (buffer[:long_bytes].view(torch.int64), buffer[long_bytes:lengths].view(torch.int32),
                    buffer[lengths:lengths + 4 * paging.slots].view(torch.int32))

        self._long, self._int, self._lengths = regions(self._dev_staged)
        self._host_long, self._host_int, self._host_lengths = regions(self._host_staged)
        self._table = torch.zeros(paging.slots, paging.pages_per_session, dtype=torch.int32, device=self.device)
        self._host_table = torch.zeros(paging.slots, paging.pages_per_session, dtype=torch.int32, pin_memory=pin)
        self._host_lengths[0] = 1  # the scratch slot holds position 0 (padding tokens see their own row)
        # numpy views of the staging buffers: a numpy store costs ~0.1 us, a tensor __setitem__ ~5
        self._np_table, self._np_lengths = self._host_table.numpy(), self._host_lengths.numpy()
        self._copied = torch.cuda.Event() if pin else None
        self._graphs: dict[tuple[int, str], _StepGraph] | None = None
        if cuda_graphs:
            if self.device.type != "cuda":
                raise StepRefused("CUDA graphs need a cuda artifact")
            if not program.single_threaded:
                raise StepRefused("CUDA graphs need the artifact loaded for capture: load_artifact(path, single_threaded=True)")
            self._graphs = {}
        self._widths = graph_widths(manifest.max_write)
        # ordinary launches: a one-token step the general program runs goes in at the width it was
        # compiled from (2: design section 4.3), beside a scratch token
        self._min_width = 1 if program.method_for(1) != STEP_METHOD else program.general_min_width
        #: per width: the device and host ``[2, width]`` views of the token buffers (:meth:`_views`)
        self._staging: dict[int, _Staging] = {}
        self._steps = self._failed = self._refused = self._captures = self._replays = self._padded = 0
        #: steps launched per method (``model``, ``decode``, ``sessions``), failed ones included
        self._method_steps: dict[str, int] = {}
        #: the method the last launched step ran
        self.last_method: str | None = None
        self._exclusive = Exclusive("runner")

    # -- sessions -------------------------------------------------------------------------------
    def open(self) -> int:
        """A new session (a free slot); its id. Refused when every slot is taken."""
        with self._exclusive:
            return self._open()

    def _open(self) -> int:
        if not self._free_slots:
            raise StepRefused(f"all {self.paging.max_sessions} session slots are taken (the artifact's --max-sessions); close one first")
        sid = next(self._ids)
        self._sessions[sid] = _Session(slot=self._free_slots.pop())
        return sid

    def close(self, sid: int) -> None:
        """The session leaves: its slot and pages go back (their rows are poisoned in check mode)."""
        with self._exclusive:
            self._close(sid)

    def _close(self, sid: int) -> None:
        session = self._session(sid)
        del self._sessions[sid]
        if self.poison:
            self._poison(session)
        self._free_pages.extend(reversed(session.pages))
        self._np_table[session.slot] = 0
        self._np_lengths[session.slot] = 0
        self._free_slots.append(session.slot)

    def _poison(self, session: _Session) -> None:
        for tensor, s in zip(self.storage, self.manifest.storage_inputs()):
            if self.manifest.owner(s)[0].window is None:
                if session.pages:
                    tensor[torch.tensor(session.pages, device=self.device)] = float("nan")
            else:
                tensor[session.slot] = float("nan")

    def _session(self, sid: int) -> _Session:
        session = self._sessions.get(sid)
        if session is None:
            raise StepRefused(f"session {sid!r} is not open in this runner")
        return session

    def length(self, sid: int) -> int:
        return self._session(sid).length

    def slot(self, sid: int) -> int:
        return self._session(sid).slot

    def pages(self, sid: int) -> list[int]:
        """The session's pages, in position order."""
        return list(self._session(sid).pages)

    @property
    def sessions(self) -> list[int]:
        return list(self._sessions)

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def pages_needed(self, sid: int, tokens: int) -> int:
        """New pages a step of ``tokens`` tokens takes for session ``sid``."""
        return self._pages_needed(self._session(sid), tokens)

    # -- the step -------------------------------------------------------------------------------
    def step(self, feeds: Mapping[int, Sequence[int]]) -> dict[int, list[torch.Tensor]]:
        """One packed step: ``feeds`` maps session ids to their next token ids (the order is the
        packing order). Returns, per session, the program's outputs restricted to its tokens
        (each output's token dim is the packed axis: dim 1 of ``[1, T, ...]``)."""
        with self._exclusive:
            return self._step(feeds)

    def _step(self, feeds: Mapping[int, Sequence[int]]) -> dict[int, list[torch.Tensor]]:
        plan, total = self._admit(feeds)
        taken: list[tuple[_Session, list[int]]] = []
        try:
            free = self._free_pages
            for session, _, need in plan:
                if need:
                    new = [free.pop() for _ in range(need)]
                    session.pages.extend(new)
                    taken.append((session, new))
            width = self._width(total)
            self._fill(feeds, plan, width)
            # a decode step (one token a session) may run the sessions method (design section 10)
            outputs = self._launch(width, all(n == 1 for _, n, _ in plan))
        except StepRefused:
            self._give_back(taken)
            self._refused += 1
            raise
        except Exception as exc:  # the compiled program's errors surface as RuntimeError
            self._give_back(taken)
            self._failed += 1
            raise StepFailed(f"batched step of {len(plan)} sessions failed; no session was advanced: {first_line(exc)}") from exc
        sizes = [n for _, n, _ in plan]
        if width > total:
            sizes.append(width - total)  # the padding tokens' outputs, dropped
        # one split per output (a view per session), not a slice per session and output
        per_output = [None if out.dim() < 2 else (out,) if len(sizes) == 1 else out.split_with_sizes(sizes, 1)
                      for out in outputs]
        results: dict[int, list[torch.Tensor]] = {}
        if len(outputs) == 1 and per_output[0] is not None:  # the usual program: logits alone
            for sid, (session, n, _), part in zip(feeds, plan, per_output[0]):
                session.length += n
                results[sid] = [part]
        else:
            for i, (sid, (session, n, _)) in enumerate(zip(feeds, plan)):
                session.length += n
                results[sid] = [out if parts is None else parts[i] for out, parts in zip(outputs, per_output)]
        self._steps += 1
        return results

    def _pages_needed(self, session: _Session, tokens: int) -> int:
        if not self._flat:
            return 0
        return max(0, pages_for(session.length + tokens, self.paging.page_size) - len(session.pages))

    def _admit(self, feeds: Mapping[int, Sequence[int]]) -> tuple[list[tuple[_Session, int, int]], int]:
        """``(session, tokens, new pages)`` per feed and the step's token count, or StepRefused
        with nothing changed. A decode feed (one token) takes the short path: its checks are the
        same, written for one token (this loop runs once per session and step)."""
        try:
            if not feeds:
                raise StepRefused("a step needs the tokens of at least one session")
            plan = []
            total = need = 0
            vocab, capacity, flat = self.vocab, self.manifest.max_capacity, self._flat
            page_size = self.paging.page_size
            sessions = self._sessions
            for sid, tokens in feeds.items():
                session = sessions.get(sid)
                if session is None:
                    raise StepRefused(f"session {sid!r} is not open in this runner")
                n = len(tokens)
                if n == 1:
                    t = tokens[0]
                    if type(t) is not int or not 0 <= t < vocab:
                        self._bad_tokens(sid, tokens, vocab)
                    if flat:
                        length = session.length
                        if length >= capacity:
                            raise StepRefused(f"session {sid}: {length} + 1 tokens exceed the max capacity of {capacity}")
                        # a new page exactly when the session's pages are full (pages_for(length + 1))
                        pages = 1 if length >= len(session.pages) * page_size else 0
                    else:
                        pages = 0
                else:
                    if n < 1:
                        raise StepRefused(f"session {sid}: a step feeds at least one token")
                    if not (all(type(t) is int for t in tokens) and 0 <= min(tokens) and max(tokens) < vocab):
                        self._bad_tokens(sid, tokens, vocab)
                    if flat and session.length + n > capacity:
                        raise StepRefused(
                            f"session {sid}: {session.length} + {n} tokens exceed the max capacity of {capacity}"
                        )
                    pages = self._pages_needed(session, n)
                plan.append((session, n, pages))
                total += n
                need += pages
            if total > self.manifest.max_write:
                raise StepRefused(f"the step carries {total} tokens; one step writes at most {self.manifest.max_write} (max_write)")
            if need > len(self._free_pages):
                raise PoolExhausted(
                    f"the step needs {need} new pages and the pool of {self.pool_pages} pages of {self.paging.page_size} rows "
                    f"has {len(self._free_pages)} free; close sessions or open the runner with a larger pool_pages"
                )
        except StepRefused:
            self._refused += 1
            raise
        return plan, total

    @staticmethod
    def _bad_tokens(sid: int, tokens: Sequence[int], vocab: int) -> None:
        """Refuse the first token that is no int id inside the vocabulary (``bool`` is none)."""
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise StepRefused(f"session {sid}: token {bad[0]!r} is outside [0, {vocab}) (the vocabulary)")

    def _give_back(self, taken: list[tuple[_Session, list[int]]]) -> None:
        for session, new in reversed(taken):
            del session.pages[len(session.pages) - len(new) :]
            self._free_pages.extend(reversed(new))
            self._np_table[session.slot, len(session.pages) : len(session.pages) + len(new)] = 0
            session.table_rows = -1  # the device row may name pages given back: rewrite it next time

    def _width(self, total: int) -> int:
        if self._graphs is None:
            return max(total, self._min_width)
        return next(w for w in self._widths if w >= total)

    def _fill(self, feeds: Mapping[int, Sequence[int]], plan: list[tuple[_Session, int, int]], width: int) -> None:
        """The step's inputs on the host, then one copy each into the device buffers."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        flat = self._flat
        page_size = self.paging.page_size
        dirty = []  # slots whose page table changed: only their rows are copied
        lengths, table = self._np_lengths, self._np_table
        for tokens, (session, n, _) in zip(feeds.values(), plan):
            start = session.length
            slot = session.slot
            if n == 1:  # a decode token
                ids.append(tokens[0])
                positions.append(start)
                slots.append(slot)
                rows.append(paged_row(session.pages, start, page_size) if flat else 0)
            else:
                ids.extend(tokens)
                span = range(start, start + n)
                positions.extend(span)
                slots.extend([slot] * n)
                if flat:
                    rows.extend(paged_row(session.pages, p, page_size) for p in span)
                else:
                    rows.extend([0] * n)
            if flat and session.table_rows != len(session.pages):
                table[slot, : len(session.pages)] = session.pages
                dirty.append(session)
            lengths[slot] = start + n
        used = len(ids)
        self._padded += width - used
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the staging buffers
        views = self._views(width)
        host_long, host_int = views.np_long, views.np_int
        host_long[0, :used] = ids
        host_long[1, :used] = positions
        host_int[0, :used] = slots
        host_int[1, :used] = rows
        host_long[:, used:width] = 0  # padding: the scratch slot's position 0, its row 0
        host_int[:, used:width] = 0
        blocking = self._copied is None
        # tokens, positions, slots, rows and lengths: one copy of the whole staging buffer (13 KB at
        # max_write 512), the regions a narrower step does not read included
        self._dev_staged.copy_(self._host_staged, non_blocking=not blocking)
        if dirty:  # the table rows from the first dirty slot to the last: one copy
            lo = min(s.slot for s in dirty)
            hi = max(s.slot for s in dirty) + 1
            self._table[lo:hi].copy_(self._host_table[lo:hi], non_blocking=not blocking)
            for session in dirty:
                session.table_rows = len(session.pages)
        if self._copied is not None:
            self._copied.record()

    def _views(self, width: int) -> "_Staging":
        """The ``[2, row]`` views (``row`` = ``width`` rounded up to 4) of the token buffers that a
        step of ``width`` tokens fills and copies whole, made once per width (a tensor view costs
        microseconds); the program reads their first ``width`` columns."""
        views = self._staging.get(width)
        if views is None:
            row = _aligned(width)  # each view's second row 16-byte aligned, as compiled kernels assume
            n = 2 * row
            views = self._staging[width] = _Staging(
                self._long[:n].view(2, row), self._host_long[:n].view(2, row).numpy(),
                self._int[:n].view(2, row), self._host_int[:n].view(2, row).numpy(),
            )
        return views

    def _inputs(self, width: int) -> list[torch.Tensor]:
        """The program's inputs for a step of ``width`` tokens: fixed views, made once per width."""
        views = self._views(width)
        if not views.inputs:
            model = [torch.empty(0)] * 2
            # [1, width] in the one layout of its shape (stride width, not the buffer's row length,
            # on the size-1 dim: the compiled wrappers' own input checks compare every stride)
            model[self._tokens_index] = views.dev_long[0, :width].view(1, width)
            model[self._positions_index] = views.dev_long[1, :width]  # type: ignore[index]
            batch = {"token_slots": views.dev_int[0, :width], "token_rows": views.dev_int[1, :width],
                     "page_table": self._table, "session_lengths": self._lengths}
            views.inputs = [*model, *self.storage, *(batch[name] for name in BATCH_INPUTS)]
        return views.inputs

    def _launch(self, width: int, one_row_per_session: bool) -> list[torch.Tensor]:
        """Run the step (its inputs filled) by the method for ``width`` tokens (``one_row_per_session``:
        every token its session's only new row; padding tokens all write the scratch row, alike)."""
        method = self.last_method = (self.program.method_for(width, True) if one_row_per_session
                                     else self.program.method_for(width))
        self._method_steps[method] = self._method_steps.get(method, 0) + 1
        if self._graphs is None:
            return self.program.run(self._inputs(width), width=width, one_row_per_session=one_row_per_session)
        graph = self._graphs.get((width, method))
        if graph is None:
            graph = self._graphs[(width, method)] = self._capture(width, one_row_per_session)
        graph.graph.replay()
        self._replays += 1
        return [out.clone() for out in graph.outputs]

    def _capture(self, width: int, one_row_per_session: bool) -> _StepGraph:
        """Capture the step of ``width`` tokens over the fixed buffers (after a warm-up on a side
        stream, which runs this step once: the replay then writes the same rows again)."""
        inputs = self._inputs(width)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.program.run(inputs, width=width, one_row_per_session=one_row_per_session)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.program.run(inputs, width=width, one_row_per_session=one_row_per_session)
        self._captures += 1
        return _StepGraph(graph, outputs)

    # -- metrics ----------------------------------------------------------------------------------
    def metrics(self) -> BatchMetrics:
        live = sum(size * (s.length if keep is None else min(s.length, keep))
                   for s in self._sessions.values() for size, keep in self._row_bytes)
        return BatchMetrics(
            sessions=len(self._sessions),
            steps=self._steps,
            failed_steps=self._failed,
            refused_steps=self._refused,
            pool_pages=self.pool_pages,
            free_pages=len(self._free_pages),
            allocated_bytes=sum(t.numel() * t.element_size() for t in self.storage),
            live_bytes=live,
            graph_captures=self._captures,
            graph_replays=self._replays,
            padded_tokens=self._padded,
            method_steps=dict(self._method_steps),
        )
