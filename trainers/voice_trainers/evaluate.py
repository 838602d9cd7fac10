"""``evaluate``: scores the trained full and light models before the worker commits them.

Held-out sentences (``voice_trainers/sentences/<language>.txt``, never the job's own transcripts) are
synthesised by the full model (Coqui VITS from ``full/model.pth`` and ``full/config.json``) and by the
light one (``light/model.onnx`` through Piper, as a user of the voice would run it). Each model's output
is scored for speaker similarity against the job's own recordings, intelligibility (CER and WER of a
speech recogniser's transcript), naturalness (DNSMOS) and sanity; the job's recordings themselves are
scored the same way (``reference``): what a perfect clone would get. The report is ``<out>/quality.json``
(docs/trainer.md, "Evaluation"); the worker's gate reads it and decides. This stage exits 0 whenever it
could score, however bad the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from voice_trainers.checkpoints import atomic_write
from voice_trainers.dataset import Clip, UnusableData, load_clips
from voice_trainers.profiles import Profile
from voice_trainers.speakers import SPEAKERS_NAME, read_centroid

REPORT_NAME = "quality.json"
REPORT_VERSION = 1
# Held-out sentences synthesised per model: ci's must cost less wall time than its train_full
# (benchmarks/evaluate_cost.py); production scores more text for steadier figures.
SENTENCES_PER_PROFILE = {"ci": 2, "production": 8}
DEFAULT_SENTENCES = 8
# The speaker's centroid is taken over at most this many of the job's clips, spread over the dataset
# (ci: a few, for its time budget).
SPEAKER_CLIPS_PER_PROFILE = {"ci": 8, "production": 64}
DEFAULT_SPEAKER_CLIPS = 64
NOTE_MAX_CHARS = 500


def sentence_count(profile: Profile) -> int:
    return SENTENCES_PER_PROFILE.get(profile.name, DEFAULT_SENTENCES)


def spread(items: list[Clip], count: int) -> list[Clip]:
    """``count`` items evenly spread over ``items`` (all of them when there are no more)."""
    if len(items) <= count:
        return list(items)
    return [items[(i * len(items)) // count] for i in range(count)]


def split_reference(clips: list[Clip], count: int) -> tuple[list[Clip], list[Clip]]:
    """The held-out half (every other clip, at most ``count``) and the rest, whose centroid it is scored
    against: a clip is never compared with a centroid it is part of."""
    held_out = clips[1::2][:count]
    held = {clip.uid for clip in held_out}
    return held_out, [clip for clip in clips if clip.uid not in held]


def read_clip(clip: Clip) -> Any:
    import soundfile

    from voice_trainers.scoring import Utterance

    samples, rate_hz = soundfile.read(str(clip.wav_path), dtype="float32")
    return Utterance(samples=samples, rate_hz=rate_hz, text=clip.text)


def synthesise_full(model_path: Path, sentences: list[str]) -> list[Any]:
    """The sentences spoken by the full model, as Coqui's VITS inference gives them (seeded)."""
    from voice_trainers.coqui import import_torch
    from voice_trainers.light import load_full_model
    from voice_trainers.scoring import Utterance

    torch = import_torch()
    model = load_full_model(model_path)
    rate_hz = model.config.audio.sample_rate
    torch.manual_seed(0)
    out = []
    with torch.inference_mode():
        for sentence in sentences:
            ids = model.tokenizer.text_to_ids(sentence)
            audio = model.inference(torch.LongTensor([ids]),
                                    aux_input={"x_lengths": torch.LongTensor([len(ids)])})["model_outputs"]
            out.append(Utterance(samples=audio.reshape(-1).float().cpu().numpy(), rate_hz=rate_hz, text=sentence))
    return out


def synthesise_light(onnx_path: Path, sentences: list[str]) -> list[Any]:
    """The sentences spoken by Piper with the light pair (``model.onnx`` + ``model.onnx.json``) and Piper's
    default synthesis settings (peak-normalised), what a user of the voice hears: each sentence normalised
    first, as the product must do (Piper reads raw text; the full model's tokenizer normalises itself)."""
    import numpy as np
    from piper import PiperVoice

    from voice_trainers.normalise import normalise
    from voice_trainers.scoring import Utterance

    voice = PiperVoice.load(str(onnx_path))
    out = []
    for sentence in sentences:
        spoken = normalise(sentence, voice.config.espeak_voice)
        chunks = [chunk.audio_float_array for chunk in voice.synthesize(spoken)]
        samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        out.append(Utterance(samples=samples, rate_hz=voice.config.sample_rate, text=sentence))
    return out


def cost(started_wall: float) -> dict[str, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "cpu_s": round(usage.ru_utime + usage.ru_stime + children.ru_utime + children.ru_stime, 2),
        "wall_s": round(time.time() - started_wall, 2),
        # ru_maxrss is in KiB on Linux.
        "peak_rss_mib": round(max(usage.ru_maxrss, children.ru_maxrss) / 1024, 1),
    }


def process_start_time() -> float:
    """When this process started (the imports before the stage's code count in its wall time)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # psutil missing or /proc unreadable: from now, a slight undercount
        return time.time()


def summary(entry: Mapping[str, Any]) -> str:
    cer = "n/a" if entry["cer"] is None else f"{entry['cer']:.2f}"
    wer = "n/a" if entry["wer"] is None else f"{entry['wer']:.2f}"
    dnsmos = entry["dnsmos"]
    sane = "sane" if entry["sanity"]["ok"] else "NOT sane (" + "; ".join(entry["sanity"]["problems"][:2]) + ")"
    return (f"similarity {entry['speaker_similarity']:.2f}, cer {cer}, wer {wer},"
            f" dnsmos {dnsmos['ovrl']:.2f}/{dnsmos['sig']:.2f}/{dnsmos['bak']:.2f}, {sane}")


def note_line(report: Mapping[str, Any]) -> str:
    parts = [f"{name}: {summary(entry)}" for name, entry in report["models"].items()]
    parts.append(f"reference: {summary(report['reference'])}")
    text = (f"NOTE quality ({report['language']}, {len(report['sentences'])} held-out sentences; dnsmos"
            f" ovrl/sig/bak) " + " | ".join(parts))
    return text[:NOTE_MAX_CHARS]


def speaker_reference(full_model: Path, embeddings: list[Any]) -> Any:
    """The centroid the models are scored against: the speaker data preparation kept (``speakers.pth``
    beside ``model.pth`` in the pipeline), or for a stage run without it, that of the clips read here."""
    from voice_trainers.scoring.similarity import centroid

    speakers = full_model.parent / SPEAKERS_NAME
    print(f"speaker centroid: {speakers.name if speakers.is_file() else 'the clips read here'}", flush=True)
    return read_centroid(speakers) if speakers.is_file() else centroid(embeddings)


def run_evaluate(args: argparse.Namespace, profile: Profile, voice: str) -> dict[str, Any]:
    started_wall = process_start_time()
    from voice_trainers.sentences import held_out, languages

    sentences = held_out(voice, sentence_count(profile))
    if not sentences:
        # A retry would find no list either; the gate cannot judge a model nobody scored.
        raise UnusableData(f"no held-out sentences for espeak-ng voice {voice!r} (lists ship for "
                           f"{', '.join(languages())}): the models cannot be scored")
    for path in (args.full_model, args.full_model.parent / "config.json", args.light_model,
                 Path(f"{args.light_model}.json")):
        if not path.is_file():
            # An earlier stage's output: the worker checked it, so this is not the data's fault (retried).
            raise RuntimeError(f"{path} is missing")
    clips = load_clips(args.dataset, min_clip_s=profile.min_clip_s, max_clip_s=profile.max_clip_s,
                       min_clips=2)  # the earlier stages held the data to the profile's minimum
    speaker_clips = spread(clips, SPEAKER_CLIPS_PER_PROFILE.get(profile.name, DEFAULT_SPEAKER_CLIPS))
    print(f"evaluate: {len(sentences)} held-out sentence(s), {len(speaker_clips)} of {len(clips)} clip(s)"
          " for the speaker", flush=True)

    from voice_trainers.scoring import Scorers
    from voice_trainers.scoring.similarity import centroid

    scorers = Scorers(voice)
    print(f"scorers loaded at {time.time() - started_wall:.1f} s", flush=True)
    print("PROGRESS 10", flush=True)
    recordings = {clip.uid: read_clip(clip) for clip in speaker_clips}
    embeddings = {uid: scorers.encoder.embed(utterance) for uid, utterance in recordings.items()}
    speaker = speaker_reference(args.full_model, list(embeddings.values()))
    held, rest = split_reference(speaker_clips, len(sentences))
    print("PROGRESS 25", flush=True)

    transcripts: dict[str, list[str]] = {}
    reference, transcripts["reference"] = scorers.score([recordings[c.uid] for c in held],
                                                         centroid([embeddings[c.uid] for c in rest]),
                                                         embeddings=[embeddings[c.uid] for c in held])
    print(f"reference scored at {time.time() - started_wall:.1f} s", flush=True)
    print("PROGRESS 40", flush=True)
    models: dict[str, Any] = {}
    models["full"], transcripts["full"] = scorers.score(synthesise_full(args.full_model, sentences), speaker)
    print(f"full model scored at {time.time() - started_wall:.1f} s", flush=True)
    print("PROGRESS 70", flush=True)
    models["light"], transcripts["light"] = scorers.score(synthesise_light(args.light_model, sentences), speaker)
    print(f"light model scored at {time.time() - started_wall:.1f} s", flush=True)
    print("PROGRESS 95", flush=True)
    for name, heard in transcripts.items():
        for text in heard:
            print(f"heard ({name}): {text!r}", flush=True)

    report = {"version": REPORT_VERSION, "language": args.language, "sentences": sentences,
              "models": models, "reference": reference, "cost": cost(started_wall)}
    text = json.dumps(report, indent=2, ensure_ascii=False) + "\n"
    atomic_write(args.out / REPORT_NAME, lambda handle: handle.write(text.encode("utf-8")))
    print(note_line(report), flush=True)
    c = report["cost"]
    print(f"wrote {REPORT_NAME} ({c['cpu_s']} CPU-s, {c['wall_s']} s wall, peak RSS {c['peak_rss_mib']} MiB)",
          flush=True)
    return report
