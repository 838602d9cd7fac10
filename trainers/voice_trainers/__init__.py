"""Real trainer stages for voice-worker (docs/trainer.md, "Real trainers").

The modules imported by ``cli`` at start (``dataset``, ``languages``, ``profiles``, ``checkpoints``,
``signals``, ``piper_json``) import nothing heavy, so the worker's test suite can exercise them without
torch; ``embed``, ``full`` and ``light`` import torch, Coqui and Resemblyzer inside their functions.
"""
