"""Host residence and lineage: how long offloaded pages sat in host memory (L2) until a load-back
read them (submit to submit), which offload wrote them, and which were freed never read (waste).

A :class:`HostPool` keeps per page of one host pool, in NumPy arrays, what the offload that last
wrote it left: its submit time (0: none seen), cause, bytes per page and span, and whether a
load-back read the page since. Ops and frees come in submission order; an op's slots become
pages once, and every event is a few vectorised calls whatever its size.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from .. import semconv as sc
from ..adapters import causes
from ..diagnostics import warn_once

OFFLOAD_CAUSES: tuple[str, ...] = (*causes()["offload"], sc.CAUSE_MIXED)  # what hicache.offload_cause can be
_CAUSE_INDEX = {cause: index for index, cause in enumerate(OFFLOAD_CAUSES)}

MAX_LINKS = 16  # links of a load-back span to the offloads that wrote its pages; the rest: links_dropped
OFFLOAD_LINK_ATTRIBUTES = {sc.LINK_TO: sc.LINK_TO_OFFLOAD}  # of every such link (shared, never mutated)


class Waste(NamedTuple):
    """Pages freed or overwritten never read since written, per ``OFFLOAD_CAUSES`` index."""

    bytes_by_cause: list[int]
    pages_by_cause: list[int]


class Reuse(NamedTuple):
    """What a load-back read: its pages' residence, grouped by the offload that wrote them."""

    residence_ns: Sequence[int]  # one per writing offload (distinct write time), oldest first
    causes: Sequence[str]  # their causes
    bytes_by_cause: list[int]  # per OFFLOAD_CAUSES index
    min_ns: int | None
    max_ns: int | None
    unknown_pages: int  # no write seen (before tracking began)
    writers: Any  # a page per writing offload, newest first, and its write time (for links at the
    writers_ns: Any  # span's start: a page written again since links nothing)


class HostPool:
    """The residence bookkeeping of one host pool of ``slots`` token slots in pages of ``page_size``."""

    def __init__(self, slots: int, page_size: int, name: str = "kv") -> None:
        import numpy as np

        if page_size < 1 or slots < 1:
            raise ValueError(f"a host pool needs slots >= 1 and page_size >= 1, got {slots} and {page_size}")
        self.np, self.name, self.page_size = np, name, page_size
        self.size = size = -(-slots // page_size)
        self.written_ns = np.zeros(size, np.int64)
        self.cause = np.zeros(size, np.int8)
        self.page_bytes = np.zeros(size, np.int64)
        self.trace_hi = np.zeros(size, np.uint64)  # the writing offload span's trace id
        self.trace_lo = np.zeros(size, np.uint64)
        self.span_id = np.zeros(size, np.uint64)  # 0: not sampled (no link)
        self.reloaded = np.zeros(size, np.bool_)

    def pages(self, page_bytes: bytes) -> Any:
        """The distinct in-range pages of ``record.page_bytes``, ascending; out-of-range ones
        are dropped, warned once."""
        np = self.np
        pages = np.frombuffer(page_bytes, np.int64)
        if pages.size > 1:  # repeats of the previous page dropped in O(n); a sort only if still unordered
            pages = pages[np.concatenate(((True,), pages[1:] != pages[:-1]))]
            if (pages[1:] <= pages[:-1]).any():
                pages = np.unique(pages)
        if pages.size and (pages[0] < 0 or pages[-1] >= self.size):
            warn_once(f"host_slots:{self.name}", "otel-hicache: host slots outside the %s host pool (%d pages "
                      "of %d); those pages are not tracked", self.name, self.size, self.page_size)
            pages = pages[(pages >= 0) & (pages < self.size)]
        return pages

    def _waste(self, pages: Any) -> Waste | None:
        np, n = self.np, len(OFFLOAD_CAUSES)
        pages = pages[(self.written_ns[pages] != 0) & ~self.reloaded[pages]]
        if pages.size == 0:
            return None
        causes_ = self.cause[pages]
        return Waste(np.bincount(causes_, weights=self.page_bytes[pages], minlength=n).astype(np.int64).tolist(),
                     np.bincount(causes_, minlength=n).tolist())

    def written(self, pages: Any, when_ns: int, cause: str, num_bytes: int) -> Waste | None:
        """An offload wrote ``pages`` at ``when_ns``: returns the waste of what it overwrote."""
        if pages.size == 0:
            return None
        waste = self._waste(pages)
        base, extra = divmod(num_bytes, int(pages.size))  # exact: the op's bytes over its pages, remainder first
        self.written_ns[pages] = when_ns
        self.cause[pages] = _CAUSE_INDEX.get(cause, _CAUSE_INDEX[sc.CAUSE_OTHER])
        self.page_bytes[pages] = base
        self.page_bytes[pages[:extra]] += 1
        self.span_id[pages] = 0
        self.reloaded[pages] = False
        return waste

    def link(self, pages: Any, trace_id: int, span_id: int) -> None:
        """The span of the offload that wrote ``pages`` (sampled ones: links point at it)."""
        self.trace_hi[pages] = trace_id >> 64
        self.trace_lo[pages] = trace_id & 0xFFFF_FFFF_FFFF_FFFF
        self.span_id[pages] = span_id

    def read(self, pages: Any, when_ns: int) -> Reuse | None:
        """A load-back read ``pages`` at ``when_ns``."""
        if pages.size == 0:
            return None
        np, n = self.np, len(OFFLOAD_CAUSES)
        known = pages[self.written_ns[pages] != 0]
        unknown = int(pages.size - known.size)
        if known.size == 0:
            return Reuse((), (), [0] * n, None, None, unknown, known, known)
        when = self.written_ns[known]
        order = np.argsort(when, kind="stable")  # (stable: the lowest page of each write)
        when, known_sorted = when[order], known[order]
        firsts = np.flatnonzero(np.concatenate(((True,), when[1:] != when[:-1])))  # one per writing offload
        residence = np.maximum(when_ns - when[firsts], 0)
        writers = known_sorted[firsts]
        bytes_by_cause = np.bincount(self.cause[known], weights=self.page_bytes[known], minlength=n)
        self.reloaded[known] = True
        return Reuse(residence.tolist(), [OFFLOAD_CAUSES[c] for c in self.cause[writers].tolist()],
                     bytes_by_cause.astype(np.int64).tolist(), int(residence.min()), int(residence.max()),
                     unknown, writers[::-1], when[firsts][::-1])

    def links(self, reuse: Reuse) -> tuple[list[tuple[int, int]], int]:
        """The sampled offload spans that wrote a load-back's pages, newest first, at most
        :data:`MAX_LINKS`, and how many more there were (asked when its span starts)."""
        writers = reuse.writers
        writers = writers[(self.written_ns[writers] == reuse.writers_ns) & (self.span_id[writers] != 0)]
        first = writers[:MAX_LINKS]
        links = [((hi << 64) | lo, span) for hi, lo, span in zip(
            self.trace_hi[first].tolist(), self.trace_lo[first].tolist(), self.span_id[first].tolist())]
        return links, max(0, int(writers.size) - MAX_LINKS)

    def freed(self, pages: Any) -> Waste | None:
        """The host application freed ``pages``: what of them was never read is waste."""
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
