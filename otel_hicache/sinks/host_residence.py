"""How long offloaded pages sat in host memory until read, who wrote them, and waste."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import numpy as np

from .. import semconv as sc
from ..adapters import causes
from ..diagnostics import warn_once

OFFLOAD_CAUSES = (*causes()["offload"], sc.CAUSE_MIXED)
_CAUSE_INDEX = {cause: index for index, cause in enumerate(OFFLOAD_CAUSES)}
_N = len(OFFLOAD_CAUSES)
MAX_LINKS = 16  # a load-back's links to the offloads that wrote its pages
# per writer, oldest first (writers: newest first)
Reuse = namedtuple("Reuse", "residence_ns causes bytes_by_cause unknown_pages writers writers_ns")


class HostPool:
    """Per page: its last offload, and whether it was read since."""

    def __init__(self, slots: int, page_size: int, name: str = "kv") -> None:
        self.name, self.page_size = name, page_size
        self.size = size = -(-slots // page_size)
        self.written_ns = np.zeros(size, np.int64)  # the writer's submit; 0: none
        self.cause = np.zeros(size, np.int8)
        self.page_bytes = np.zeros(size, np.int64)
        self.trace_hi, self.trace_lo = np.zeros(size, np.uint64), np.zeros(size, np.uint64)
        self.span_id = np.zeros(size, np.uint64)  # 0: not sampled
        self.reloaded = np.zeros(size, np.bool_)

    def pages(self, slot_bytes: bytes) -> Any:
        """The distinct in-range pages, ascending."""
        pages = np.frombuffer(slot_bytes, np.int64) // self.page_size
        if pages.size > 1:  # (mostly sorted)
            pages = pages[np.concatenate(((True,), pages[1:] != pages[:-1]))]
            if (pages[1:] < pages[:-1]).any():
                pages = np.unique(pages)
        if pages.size and (pages[0] < 0 or pages[-1] >= self.size):
            warn_once(f"host_slots:{self.name}", "otel-hicache: host slots outside the %s host pool", self.name)
            pages = pages[(pages >= 0) & (pages < self.size)]
        return pages

    def written(self, pages: Any, when_ns: int, cause: str, num_bytes: int) -> Any:
        """Unread pages overwritten: (bytes, tokens) per cause index, or None."""
        if pages.size == 0:
            return None
        unread, waste = pages[(self.written_ns[pages] != 0) & ~self.reloaded[pages]], None
        if unread.size:
            waste = (np.bincount(self.cause[unread], self.page_bytes[unread], _N).astype(np.int64).tolist(),
                     (np.bincount(self.cause[unread], minlength=_N) * self.page_size).tolist())
        self.span_id[pages], self.reloaded[pages] = 0, False
        base, extra = divmod(num_bytes, int(pages.size))  # (exactly)
        self.written_ns[pages] = when_ns
        self.cause[pages] = _CAUSE_INDEX.get(cause, _CAUSE_INDEX[sc.CAUSE_OTHER])
        self.page_bytes[pages] = base
        self.page_bytes[pages[:extra]] += 1
        return waste

    def freed(self, pages: Any) -> Any:
        return self.written(pages, 0, sc.CAUSE_OTHER, 0)

    def link(self, pages: Any, trace_id: int, span_id: int) -> None:
        self.trace_hi[pages], self.trace_lo[pages] = trace_id >> 64, trace_id & 0xFFFF_FFFF_FFFF_FFFF
        self.span_id[pages] = span_id

    def read(self, pages: Any, when_ns: int) -> Any:
        known = pages[self.written_ns[pages] != 0]
        when, firsts = np.unique(self.written_ns[known], return_index=True)
        writers = known[firsts]
        self.reloaded[known] = True
        return Reuse(np.maximum(when_ns - when, 0).tolist(), [OFFLOAD_CAUSES[c] for c in self.cause[writers].tolist()],
                     np.bincount(self.cause[known], self.page_bytes[known], _N).astype(np.int64).tolist(),
                     int(pages.size - known.size), writers[::-1], when[::-1])

    def links(self, reuse: Any) -> tuple[list, int]:
        """The sampled writers still owning the pages, and how many were cut."""
        w = reuse.writers
        w = w[(self.written_ns[w] == reuse.writers_ns) & (self.span_id[w] != 0)]
        first = w[:MAX_LINKS]
        return ([((hi << 64) | lo, span) for hi, lo, span in zip(self.trace_hi[first].tolist(),
                 self.trace_lo[first].tolist(), self.span_id[first].tolist())], max(0, int(w.size) - MAX_LINKS))
