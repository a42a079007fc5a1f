"""Host residence and lineage: how long offloaded pages sat in host memory (L2) before a
load-back used them, which offload wrote them, and which were freed without ever being
loaded back (offloads that never paid off).

A :class:`HostPool` keeps, per page of one host pool, in preallocated NumPy arrays sized
from the pool: the submit time of the offload that last wrote it (0: not written since
tracking began), that offload's cause, its bytes per page, the span that offload made
(for span links), and whether the page was loaded back since. Every update is a few
vectorised operations over the op's pages, on the completion worker, in submission order
(ops and frees go through the same queue, :class:`HostFree`): the order in which the host
application handed pages out and took them back. The scheduler thread only passes a
reference to its host indices.

Times are submit times (``submit_ns``): a page is resident from the submit of the offload
that wrote it to the submit of the load-back that reads it. Tokens are pages x page size.
NumPy is needed (every framework with a host KV pool has it); without it
``TransferTelemetry.host_pool()`` returns None, warned once.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from . import semconv as sc
from .diagnostics import warn_once

OFFLOAD_CAUSES: tuple[str, ...] = (*sc.CAUSES["offload"], sc.CAUSE_MIXED)
"""What ``hicache.offload_cause`` can be: the cause of the offload that wrote a page."""
_CAUSE_INDEX = {cause: index for index, cause in enumerate(OFFLOAD_CAUSES)}

MAX_LINKS = 16
"""At most this many span links on a load-back span: the offload spans that wrote its pages,
the most recent first; the rest are counted in ``hicache.host.links_dropped``."""
OFFLOAD_LINK_ATTRIBUTES = {sc.LINK_TO: sc.LINK_TO_OFFLOAD}
"""The attributes of every such link (shared, never mutated)."""


class HostFree(NamedTuple):
    """A queue item: the host application freed ``slots`` of ``pool`` (``TransferTelemetry.host_freed``)."""

    pool: "HostPool"
    slots: Any


class Waste(NamedTuple):
    """Pages freed or overwritten without a load-back since they were written, per offload cause."""

    bytes_by_cause: Any  # NumPy int64 array indexed like OFFLOAD_CAUSES
    pages_by_cause: Any


class Reuse(NamedTuple):
    """What a load-back read: its pages' residence, grouped by the offload that wrote them."""

    residence_ns: Sequence[int]  # one per writing offload (distinct write time), oldest write first
    causes: Sequence[str]  # the cause of each of those offloads
    bytes_by_cause: Any  # bytes read, per OFFLOAD_CAUSES index
    min_ns: int | None
    max_ns: int | None
    unknown_pages: int  # pages with no write seen since tracking began (before a restart, say)
    writers: Any  # one page per writing offload, newest first (their spans: links, at the span's start)
    writers_ns: Any  # those pages' write times when read (a page written again since links nothing)


class HostPool:
    """The residence bookkeeping of one host pool of ``slots`` token slots in pages of ``page_size``."""

    def __init__(self, slots: int, page_size: int, name: str = "kv") -> None:
        import numpy as np

        if page_size < 1 or slots < 1:
            raise ValueError(f"a host pool needs slots >= 1 and page_size >= 1, got {slots} and {page_size}")
        self.np = np
        self.name = name
        self.page_size = page_size
        self.pages = -(-slots // page_size)
        self.written_ns = np.zeros(self.pages, np.int64)
        self.cause = np.zeros(self.pages, np.int8)
        self.page_bytes = np.zeros(self.pages, np.int64)
        self.trace_hi = np.zeros(self.pages, np.uint64)  # the writing offload span's trace id, 2 x 64 bits
        self.trace_lo = np.zeros(self.pages, np.uint64)
        self.span_id = np.zeros(self.pages, np.uint64)  # 0: not sampled (no link)
        self.reloaded = np.zeros(self.pages, np.bool_)

    @property
    def bytes_per_page(self) -> int:
        """Memory the bookkeeping takes per host page."""
        return sum(a.itemsize for a in (self.written_ns, self.cause, self.page_bytes, self.trace_hi,
                                        self.trace_lo, self.span_id, self.reloaded))

    # -- pages of an op -----------------------------------------------------------
    def page_ids(self, slots: Any) -> Any:
        """The distinct pages of ``slots`` (token slot indices: a NumPy or CPU torch array, a
        sequence, or a callable returning one), in range; out-of-range ones dropped, warned once."""
        np = self.np
        if callable(slots):
            slots = slots()
        if isinstance(slots, (list, tuple)) and slots and not isinstance(slots[0], int):
            slots = np.concatenate([np.asarray(part).reshape(-1) for part in slots])  # several index arrays
        array = np.asarray(slots).reshape(-1)
        if array.size == 0:
            return array.astype(np.int64)
        if array.dtype.kind not in "iu":
            raise TypeError(f"host slots must be integers, got {array.dtype}")
        size = self.page_size
        firsts = array[::size]
        if size > 1 and array.size % size == 0 and not (firsts % size).any() and \
                (array[size - 1::size] - firsts == size - 1).all():
            pages = firsts // size  # whole pages, as HiCache allocates them: one slot per page read
        else:
            # drop repeats of the previous page (O(n)); np.unique over every slot costs ~30 us
            # for a 1,408-token op, so only for what is then still not strictly increasing
            slot_pages = array // size if size > 1 else array
            pages = np.concatenate((slot_pages[:1], slot_pages[1:][slot_pages[1:] != slot_pages[:-1]]))
        if pages.size > 1 and (pages[1:] <= pages[:-1]).any():
            pages = np.unique(pages)
        if pages[0] < 0 or pages[-1] >= self.pages:
            warn_once(f"host_slots:{self.name}", "otel-hicache: host slots outside the %s host pool (%d pages of "
                      "%d); those pages are not tracked", self.name, self.pages, self.page_size)
            pages = pages[(pages >= 0) & (pages < self.pages)]
        return pages

    def _waste(self, pages: Any) -> Waste | None:
        np = self.np
        pages = pages[(self.written_ns[pages] != 0) & ~self.reloaded[pages]]
        if pages.size == 0:
            return None
        causes = self.cause[pages]
        n = len(OFFLOAD_CAUSES)
        return Waste(np.bincount(causes, weights=self.page_bytes[pages], minlength=n).astype(np.int64),
                     np.bincount(causes, minlength=n))

    # -- the three events ---------------------------------------------------------
    def written(self, slots: Any, when_ns: int, cause: str, num_bytes: int) -> tuple[Any, Waste | None]:
        """An offload wrote ``slots`` at ``when_ns``: returns its pages (for :meth:`link`) and
        the waste of what it overwrote (pages written before and never loaded back)."""
        pages = self.page_ids(slots)
        n = pages.size
        if n == 0:
            return pages, None
        waste = self._waste(pages)
        self.written_ns[pages] = when_ns
        self.cause[pages] = _CAUSE_INDEX.get(cause, _CAUSE_INDEX[sc.CAUSE_OTHER])
        base, extra = divmod(num_bytes, n)  # exact: the op's bytes over its pages, remainder first
        self.page_bytes[pages] = base
        if extra:
            self.page_bytes[pages[:extra]] += 1
        self.span_id[pages] = 0
        self.reloaded[pages] = False
        return pages, waste

    def link(self, pages: Any, trace_id: int, span_id: int) -> None:
        """The span of the offload that wrote ``pages`` (sampled ones: links point at it)."""
        if pages.size:
            self.trace_hi[pages] = trace_id >> 64
            self.trace_lo[pages] = trace_id & 0xFFFF_FFFF_FFFF_FFFF
            self.span_id[pages] = span_id

    def read(self, slots: Any, when_ns: int) -> Reuse | None:
        """A load-back read ``slots`` at ``when_ns``."""
        np = self.np
        pages = self.page_ids(slots)
        if pages.size == 0:
            return None
        written = self.written_ns[pages]
        known = pages[written != 0]
        unknown = int(pages.size - known.size)
        n = len(OFFLOAD_CAUSES)
        if known.size == 0:
            return Reuse((), (), np.zeros(n, np.int64), None, None, unknown, known, known)
        when = self.written_ns[known]
        order = np.argsort(when, kind="stable")
        when, known_sorted = when[order], known[order]
        firsts = np.flatnonzero(np.concatenate(((True,), when[1:] != when[:-1])))  # one group per writing offload
        residence = np.maximum(when_ns - when[firsts], 0)
        causes = [OFFLOAD_CAUSES[c] for c in self.cause[known_sorted[firsts]].tolist()]
        bytes_by_cause = np.bincount(self.cause[known], weights=self.page_bytes[known], minlength=n).astype(np.int64)
        self.reloaded[known] = True
        writers = known_sorted[firsts][::-1]
        return Reuse(residence.tolist(), causes, bytes_by_cause, int(residence.min()), int(residence.max()),
                     unknown, writers, when[firsts][::-1])

    def links(self, reuse: Reuse) -> tuple[list[tuple[int, int]], int]:
        """The sampled offload spans that wrote a load-back's pages, newest first, at most
        :data:`MAX_LINKS` (and how many more there were). Asked when the load-back's span
        starts: by then the offloads it read from have completed (their spans exist)."""
        writers = reuse.writers
        if writers.size == 0:
            return [], 0
        writers = writers[(self.written_ns[writers] == reuse.writers_ns) & (self.span_id[writers] != 0)]
        first = writers[:MAX_LINKS]
        links = [((hi << 64) | lo, span) for hi, lo, span in zip(
            self.trace_hi[first].tolist(), self.trace_lo[first].tolist(), self.span_id[first].tolist())]
        return links, max(0, int(writers.size) - MAX_LINKS)

    def freed(self, slots: Any) -> Waste | None:
        """The host application freed ``slots``: what of it was never loaded back is waste."""
        pages = self.page_ids(slots)
        if pages.size == 0:
            return None
        waste = self._waste(pages)
        self.written_ns[pages] = 0
        self.span_id[pages] = 0
        self.reloaded[pages] = False
        return waste


def make_host_pool(slots: int, page_size: int, name: str = "kv") -> HostPool | None:
    """A :class:`HostPool`, or None (warned once) without NumPy or with a bad size."""
    try:
        return HostPool(int(slots), int(page_size), name)
    except ImportError:
        warn_once("host_pool:numpy", "otel-hicache: host residence needs NumPy (pip install numpy); not tracked")
    except (TypeError, ValueError) as exc:
        warn_once(f"host_pool:{exc}", "otel-hicache: cannot track the %s host pool (%s)", name, exc)
    return None
