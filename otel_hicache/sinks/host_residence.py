"""Host residence and lineage: how long offloaded pages sat in host memory (L2) before a
load-back used them, which offload wrote them, and which were freed without ever being
loaded back (offloads that never paid off).

A :class:`HostPool` keeps, per page of one host pool, in preallocated arrays sized
from the pool: the submit time of the offload that last wrote it (0: not written since
tracking began), that offload's cause, its bytes per page, the span that offload made
(for span links), and whether the page was loaded back since. Every update runs on the
sinks, in submission order (ops and frees go through the same queue,
the capture's ``HostFree``): the order in which the host application handed pages out and took
them back. The scheduler thread only passes a reference to its host indices.

An op of up to :data:`SMALL_OP_PAGES` pages (most of SGLang's: a node's pages, a few
requests' prefixes) is kept in plain Python over the arrays (``array.array``, ~0.1 us an
element); a larger one in vectorised NumPy over views of the same memory (~1 us a call,
some 30 calls an event, whatever the op's size).

Times are submit times (``submit_ns``): a page is resident from the submit of the offload
that wrote it to the submit of the load-back that reads it. Tokens are pages x page size.
NumPy is needed (every framework with a host KV pool has it); without it
``TransferTelemetry.host_pool()`` returns None, warned once.
"""

from __future__ import annotations

from array import array
from typing import Any, NamedTuple, Sequence

from .. import semconv as sc
from ..adapters import causes
from ..diagnostics import warn_once

OFFLOAD_CAUSES: tuple[str, ...] = (*causes()["offload"], sc.CAUSE_MIXED)
"""What ``hicache.offload_cause`` can be: the cause of the offload that wrote a page."""
_CAUSE_INDEX = {cause: index for index, cause in enumerate(OFFLOAD_CAUSES)}

MAX_LINKS = 16
"""At most this many span links on a load-back span: the offload spans that wrote its pages,
the most recent first; the rest are counted in ``hicache.host.links_dropped``."""
OFFLOAD_LINK_ATTRIBUTES = {sc.LINK_TO: sc.LINK_TO_OFFLOAD}
"""The attributes of every such link (shared, never mutated)."""

SMALL_OP_SLOTS = 1024
SMALL_OP_PAGES = 64
"""Ops (and frees) of at most this many slots and (by their slot count) pages take the
plain-Python path; larger ones NumPy. Both give the same results (``tests/test_host_residence.py``).
On a 2-core VM, Python costs a few microseconds an event plus ~1 us a page, NumPy 25 to 70 us
an event whatever its size: they cross between 32 and 64 pages, or past 1,024 slots
(``docs/performance.md``, "Host residence")."""


class Waste(NamedTuple):
    """Pages freed or overwritten without a load-back since they were written, per offload cause."""

    bytes_by_cause: list[int]  # indexed like OFFLOAD_CAUSES
    pages_by_cause: list[int]


class Reuse(NamedTuple):
    """What a load-back read: its pages' residence, grouped by the offload that wrote them."""

    residence_ns: Sequence[int]  # one per writing offload (distinct write time), oldest write first
    causes: Sequence[str]  # the cause of each of those offloads
    bytes_by_cause: list[int]  # bytes read, per OFFLOAD_CAUSES index
    min_ns: int | None
    max_ns: int | None
    unknown_pages: int  # pages with no write seen since tracking began (before a restart, say)
    writers: Any  # one page per writing offload, newest first (their spans: links, at the span's start);
    writers_ns: Any  # those pages' write times when read (a page written again since links nothing);
    # both lists (small ops) or NumPy arrays


class HostPool:
    """The residence bookkeeping of one host pool of ``slots`` token slots in pages of ``page_size``."""

    small_op_slots = SMALL_OP_SLOTS
    small_op_pages = SMALL_OP_PAGES

    def __init__(self, slots: int, page_size: int, name: str = "kv") -> None:
        import numpy as np

        if page_size < 1 or slots < 1:
            raise ValueError(f"a host pool needs slots >= 1 and page_size >= 1, got {slots} and {page_size}")
        self.np = np
        self.name = name
        self.page_size = page_size
        self.pages = pages = -(-slots // page_size)
        # per page, in plain arrays (element access for small ops), each also seen as a NumPy view
        self._written, self.written_ns = _column("q", np.int64, pages)
        self._cause, self.cause = _column("b", np.int8, pages)
        self._bytes, self.page_bytes = _column("q", np.int64, pages)
        self._trace_hi, self.trace_hi = _column("Q", np.uint64, pages)  # the writing offload span's trace id
        self._trace_lo, self.trace_lo = _column("Q", np.uint64, pages)
        self._span, self.span_id = _column("Q", np.uint64, pages)  # 0: not sampled (no link)
        self._reloaded, self.reloaded = _column("B", np.bool_, pages)

    @property
    def bytes_per_page(self) -> int:
        """Memory the bookkeeping takes per host page."""
        return sum(a.itemsize for a in (self.written_ns, self.cause, self.page_bytes, self.trace_hi,
                                        self.trace_lo, self.span_id, self.reloaded))

    # -- pages of an op -----------------------------------------------------------
    def page_ids(self, slots: Any) -> Any:
        """The distinct pages of ``slots`` (token slot indices: a NumPy or CPU torch array, a
        sequence, a sequence of arrays, or a callable returning one), in range, ascending:
        a list for a small op, else a NumPy array. Out-of-range ones dropped, warned once."""
        if callable(slots):
            slots = slots()
        small = self._small_slots(slots)
        return self._pages_of_list(small) if small is not None else self._pages_of_array(slots)

    def _small_slots(self, slots: Any) -> list[int] | None:
        """``slots`` as a list of ints when they are few (:data:`SMALL_OP_SLOTS`, :data:`SMALL_OP_PAGES`),
        all integers in 1-D arrays or sequences; else None (the NumPy path reads them)."""
        limit = min(self.small_op_slots, self.small_op_pages * self.page_size)
        if isinstance(slots, range):
            return list(slots) if len(slots) <= limit else None
        parts = slots if isinstance(slots, (list, tuple)) and slots and not isinstance(slots[0], int) else (slots,)
        found: list[int] = []
        for part in parts:
            dtype = getattr(part, "dtype", None)
            if dtype is not None:  # a NumPy or torch array: its dtype says integers, and tolist() is one C call
                kind = getattr(dtype, "kind", None)  # NumPy's (its str() is Python code, slow); torch's str() is C
                # never tolist() a tensor outside host memory (a device tensor's would synchronize)
                if part.ndim != 1 or part.shape[0] > limit - len(found) or not getattr(part, "is_cpu", True) \
                        or not (kind in ("i", "u") if kind is not None else "int" in str(dtype)):
                    return None
                found += part.tolist()
            elif isinstance(part, (list, tuple)) and len(part) <= limit - len(found) and \
                    all(type(slot) is int for slot in part):  # pylint: disable=unidiomatic-typecheck  # not bool
                found += part
            else:
                return None
        return found

    def _pages_of_list(self, slots: list[int]) -> list[int]:
        size = self.page_size
        firsts = slots[::size] if size > 1 and len(slots) % size == 0 else None
        if firsts is not None and not any(first % size for first in firsts) and \
                slots[size - 1::size] == [first + size - 1 for first in firsts]:
            pages = [first // size for first in firsts]  # whole pages, as HiCache allocates them
        else:
            pages = []
            previous = None
            for slot in slots:
                page = slot // size
                if page != previous:
                    pages.append(page)
                    previous = page
        if any(b <= a for a, b in zip(pages, pages[1:])):
            pages = sorted(set(pages))
        if pages and (pages[0] < 0 or pages[-1] >= self.pages):
            self._warn_out_of_range()
            pages = [page for page in pages if 0 <= page < self.pages]
        return pages

    def _pages_of_array(self, slots: Any) -> Any:
        np = self.np
        if isinstance(slots, (list, tuple)) and slots and not isinstance(slots[0], int):
            slots = np.concatenate([np.asarray(part).reshape(-1) for part in slots])  # several index arrays
        array_ = np.asarray(slots).reshape(-1)
        if array_.size == 0:
            return array_.astype(np.int64)
        if array_.dtype.kind not in "iu":
            raise TypeError(f"host slots must be integers, got {array_.dtype}")
        size = self.page_size
        firsts = array_[::size]
        if size > 1 and array_.size % size == 0 and not (firsts % size).any() and \
                (array_[size - 1::size] - firsts == size - 1).all():
            pages = firsts // size  # whole pages, as HiCache allocates them: one slot per page read
        else:
            # drop repeats of the previous page (O(n)); np.unique over every slot sorts them all
            # for a 1,408-token op, so only for what is then still not strictly increasing
            slot_pages = array_ // size if size > 1 else array_
            pages = np.concatenate((slot_pages[:1], slot_pages[1:][slot_pages[1:] != slot_pages[:-1]]))
        if pages.size > 1 and (pages[1:] <= pages[:-1]).any():
            pages = np.unique(pages)
        if pages[0] < 0 or pages[-1] >= self.pages:
            self._warn_out_of_range()
            pages = pages[(pages >= 0) & (pages < self.pages)]
        return pages

    def _warn_out_of_range(self) -> None:
        warn_once(f"host_slots:{self.name}", "otel-hicache: host slots outside the %s host pool (%d pages of "
                  "%d); those pages are not tracked", self.name, self.pages, self.page_size)

    def _waste(self, pages: Any) -> Waste | None:
        n = len(OFFLOAD_CAUSES)
        if isinstance(pages, list):
            written, reloaded, cause, page_bytes = self._written, self._reloaded, self._cause, self._bytes
            unread = [page for page in pages if written[page] and not reloaded[page]]
            if not unread:
                return None
            bytes_by_cause, pages_by_cause = [0] * n, [0] * n
            for page in unread:
                index = cause[page]
                bytes_by_cause[index] += page_bytes[page]
                pages_by_cause[index] += 1
            return Waste(bytes_by_cause, pages_by_cause)
        np = self.np
        pages = pages[(self.written_ns[pages] != 0) & ~self.reloaded[pages]]
        if pages.size == 0:
            return None
        causes = self.cause[pages]
        return Waste(np.bincount(causes, weights=self.page_bytes[pages], minlength=n).astype(np.int64).tolist(),
                     np.bincount(causes, minlength=n).tolist())

    # -- the three events ---------------------------------------------------------
    def written(self, slots: Any, when_ns: int, cause: str, num_bytes: int) -> tuple[Any, Waste | None]:
        """An offload wrote ``slots`` at ``when_ns``: returns its pages (for :meth:`link`) and
        the waste of what it overwrote (pages written before and never loaded back)."""
        pages = self.page_ids(slots)
        n = len(pages)
        if n == 0:
            return pages, None
        waste = self._waste(pages)
        index = _CAUSE_INDEX.get(cause, _CAUSE_INDEX[sc.CAUSE_OTHER])
        base, extra = divmod(num_bytes, n)  # exact: the op's bytes over its pages, remainder first
        if isinstance(pages, list):
            written, causes, page_bytes, span, reloaded = (self._written, self._cause, self._bytes, self._span,
                                                           self._reloaded)
            for i, page in enumerate(pages):
                written[page] = when_ns
                causes[page] = index
                page_bytes[page] = base + 1 if i < extra else base
                span[page] = 0
                reloaded[page] = 0
            return pages, waste
        self.written_ns[pages] = when_ns
        self.cause[pages] = index
        self.page_bytes[pages] = base
        if extra:
            self.page_bytes[pages[:extra]] += 1
        self.span_id[pages] = 0
        self.reloaded[pages] = False
        return pages, waste

    def link(self, pages: Any, trace_id: int, span_id: int) -> None:
        """The span of the offload that wrote ``pages`` (sampled ones: links point at it)."""
        hi, lo = trace_id >> 64, trace_id & 0xFFFF_FFFF_FFFF_FFFF
        if isinstance(pages, list):
            trace_hi, trace_lo, span = self._trace_hi, self._trace_lo, self._span
            for page in pages:
                trace_hi[page] = hi
                trace_lo[page] = lo
                span[page] = span_id
        elif pages.size:
            self.trace_hi[pages] = hi
            self.trace_lo[pages] = lo
            self.span_id[pages] = span_id

    def read(self, slots: Any, when_ns: int) -> Reuse | None:
        """A load-back read ``slots`` at ``when_ns``."""
        pages = self.page_ids(slots)
        if len(pages) == 0:
            return None
        if isinstance(pages, list):
            return self._read_list(pages, when_ns)
        np = self.np
        written = self.written_ns[pages]
        known = pages[written != 0]
        unknown = int(pages.size - known.size)
        n = len(OFFLOAD_CAUSES)
        if known.size == 0:
            return Reuse((), (), [0] * n, None, None, unknown, known, known)
        when = self.written_ns[known]
        order = np.argsort(when, kind="stable")
        when, known_sorted = when[order], known[order]
        firsts = np.flatnonzero(np.concatenate(((True,), when[1:] != when[:-1])))  # one group per writing offload
        residence = np.maximum(when_ns - when[firsts], 0)
        causes = [OFFLOAD_CAUSES[c] for c in self.cause[known_sorted[firsts]].tolist()]
        bytes_by_cause = np.bincount(self.cause[known], weights=self.page_bytes[known], minlength=n).astype(np.int64)
        self.reloaded[known] = True
        writers = known_sorted[firsts][::-1]
        return Reuse(residence.tolist(), causes, bytes_by_cause.tolist(), int(residence.min()), int(residence.max()),
                     unknown, writers, when[firsts][::-1])

    def _read_list(self, pages: list[int], when_ns: int) -> Reuse:
        written, cause, page_bytes, reloaded = self._written, self._cause, self._bytes, self._reloaded
        known = [page for page in pages if written[page]]
        unknown = len(pages) - len(known)
        bytes_by_cause = [0] * len(OFFLOAD_CAUSES)
        if not known:
            return Reuse((), (), bytes_by_cause, None, None, unknown, [], [])
        writers, writers_ns = [], []  # one page per writing offload (distinct write time), oldest first
        previous = None
        for page in sorted(known, key=written.__getitem__):  # stable: the lowest page of each write
            when = written[page]
            if when != previous:
                writers.append(page)
                writers_ns.append(when)
                previous = when
        for page in known:
            bytes_by_cause[cause[page]] += page_bytes[page]
            reloaded[page] = 1
        residence = [when_ns - when if when_ns > when else 0 for when in writers_ns]
        causes = [OFFLOAD_CAUSES[cause[page]] for page in writers]
        return Reuse(residence, causes, bytes_by_cause, min(residence), max(residence), unknown, writers[::-1],
                     writers_ns[::-1])

    def links(self, reuse: Reuse) -> tuple[list[tuple[int, int]], int]:
        """The sampled offload spans that wrote a load-back's pages, newest first, at most
        :data:`MAX_LINKS` (and how many more there were). Asked when the load-back's span
        starts: by then the offloads it read from have completed (their spans exist)."""
        writers = reuse.writers
        if len(writers) == 0:
            return [], 0
        if isinstance(writers, list):
            written, span = self._written, self._span
            live = [page for page, when in zip(writers, reuse.writers_ns) if written[page] == when and span[page]]
            links = [((self._trace_hi[page] << 64) | self._trace_lo[page], span[page]) for page in live[:MAX_LINKS]]
            return links, max(0, len(live) - MAX_LINKS)
        writers = writers[(self.written_ns[writers] == reuse.writers_ns) & (self.span_id[writers] != 0)]
        first = writers[:MAX_LINKS]
        links = [((hi << 64) | lo, span) for hi, lo, span in zip(
            self.trace_hi[first].tolist(), self.trace_lo[first].tolist(), self.span_id[first].tolist())]
        return links, max(0, int(writers.size) - MAX_LINKS)

    def freed(self, slots: Any) -> Waste | None:
        """The host application freed ``slots``: what of it was never loaded back is waste."""
        pages = self.page_ids(slots)
        if len(pages) == 0:
            return None
        waste = self._waste(pages)
        if isinstance(pages, list):
            written, span, reloaded = self._written, self._span, self._reloaded
            for page in pages:
                written[page] = span[page] = reloaded[page] = 0
            return waste
        self.written_ns[pages] = 0
        self.span_id[pages] = 0
        self.reloaded[pages] = False
        return waste


def _column(typecode: str, dtype: Any, pages: int) -> tuple[array, Any]:
    """One zeroed per-page array and a NumPy view of its memory (writes through either are seen by both)."""
    import numpy as np

    column = array(typecode, bytes(array(typecode).itemsize * pages))
    return column, np.frombuffer(column, dtype)


def make_host_pool(slots: int, page_size: int, name: str = "kv") -> HostPool | None:
    """A :class:`HostPool`, or None (warned once) without NumPy or with a bad size."""
    try:
        return HostPool(int(slots), int(page_size), name)
    except ImportError:
        warn_once("host_pool:numpy", "otel-hicache: host residence needs NumPy (pip install numpy); not tracked")
    except (TypeError, ValueError) as exc:
        warn_once(f"host_pool:{exc}", "otel-hicache: cannot track the %s host pool (%s)", name, exc)
    return None
