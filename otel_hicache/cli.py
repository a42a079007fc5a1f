"""``otel-hicache`` command line: ``otel-hicache demo`` runs the example workload."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: otel-hicache demo [options]   (otel-hicache demo --help for the options)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from otel_hicache_examples.hicache_workload import main as demo_main

        return demo_main(rest)
    print(f"otel-hicache: unknown command {command!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
