"""How many intra-op threads torch may use: read by ``coqui.import_torch``, here on its own so the
stages' modules never import the command line (cli.py imports them)."""

from __future__ import annotations

from collections.abc import Mapping


def torch_threads(environ: Mapping[str, str]) -> int | None:
    """Intra-op threads from OMP_NUM_THREADS (the worker passes it through), None to let torch decide."""
    try:
        threads = int(environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return threads if threads > 0 else None
