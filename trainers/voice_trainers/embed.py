"""``embed``: Resemblyzer's GE2E d-vectors (256-d, the encoder ships inside the wheel) per clip.

The output is Coqui's d-vector file format: a ``torch.save``'d dict ``{clip key: {"name": speaker,
"embedding": [256 floats]}}`` (what ``TTS/bin/compute_embeddings.py`` writes and ``SpeakerManager``
reads with ``d_vector_file``); the key is Coqui's ``audio_unique_name`` of the clip.
"""

from __future__ import annotations

import argparse
import io
import time

from voice_trainers.checkpoints import atomic_write
from voice_trainers.coqui import import_torch
from voice_trainers.dataset import load_clips, require_enough
from voice_trainers.device import select_device
from voice_trainers.full import SPEAKER
from voice_trainers.profiles import Profile

SPEAKERS_NAME = "speakers.pth"
EMBEDDING_DIM = 256


def clip_key(uid: str) -> str:
    return f"#wavs/{uid}"


def run_embed(args: argparse.Namespace, profile: Profile) -> None:
    clips = load_clips(args.dataset, min_clip_s=profile.min_clip_s, max_clip_s=profile.max_clip_s,
                       min_clips=profile.min_clips)
    torch = import_torch()
    import soundfile
    from resemblyzer import VoiceEncoder, preprocess_wav

    started_s = time.process_time()
    encoder = VoiceEncoder(device=select_device(torch, profile.device), verbose=False)
    mapping = {}
    for number, clip in enumerate(clips, start=1):
        samples, rate_hz = soundfile.read(str(clip.wav_path), dtype="float32")
        # Resemblyzer resamples to 16 kHz, normalises the volume and trims long silences.
        wav = preprocess_wav(samples, source_sr=rate_hz)
        if len(wav) == 0:
            print(f"NOTE left out {clip.uid}: nothing but silence to Resemblyzer", flush=True)
            continue
        embedding = encoder.embed_utterance(wav)
        mapping[clip_key(clip.uid)] = {"name": SPEAKER, "embedding": [float(x) for x in embedding]}
        print(f"PROGRESS {100 * number / len(clips):.1f}", flush=True)
    require_enough(len(mapping), profile.min_clips, "clips with speech")
    buffer = io.BytesIO()
    torch.save(mapping, buffer)
    atomic_write(args.out / SPEAKERS_NAME, lambda handle: handle.write(buffer.getvalue()))
    print(f"wrote {SPEAKERS_NAME}: {len(mapping)} d-vectors of {EMBEDDING_DIM} dimensions"
          f" ({time.process_time() - started_s:.1f} CPU-s)", flush=True)
