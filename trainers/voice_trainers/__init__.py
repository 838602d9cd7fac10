"""Real trainer stages for voice-worker (docs/trainer.md, "Real trainers").

The modules imported by ``cli`` at start (``dataset``, ``languages``, ``profiles``, ``checkpoints``,
``signals``, ``piper_json``) import nothing heavy, so the worker's test suite can exercise them without
torch; ``embed``, ``full`` and ``light`` import torch, Coqui and Resemblyzer inside their functions.
"""

# The adapter's version, part of every checkpoint's fingerprint (pyproject.toml reads it from here): raise it
# when a change makes an older checkpoint wrong to resume, and a retry after the upgrade starts over.
__version__ = "0.3.0"
