"""Data preparation, the first half of the ``embed`` stage (docs/trainer.md, "Data preparation").

The worker's dataset (one clip per recording) becomes the prepared dataset the training stages read: long
recordings cut at sentence pauses, silence trimmed to ``PAD_S``, loudness normalised, and the clips that
would teach the model the wrong thing left out, each with its reason in ``report.json``. The speaker
filter uses the same Resemblyzer d-vectors that ``speakers.pth`` keeps (voice_trainers.speakers).
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from voice_trainers import prep_audio, prep_rules
from voice_trainers.checkpoints import atomic_write
from voice_trainers.dataset import (
    METADATA_NAME,
    PACKED_NAME,
    SAMPLE_RATE_HZ,
    WAVS_DIR_NAME,
    Clip,
    UnusableData,
    escape_text,
    unpack_prepared,
)
from voice_trainers.profiles import Profile
from voice_trainers.scoring.similarity import centroid, unit

REPORT_NAME = "report.json"
REPORT_VERSION = 1
# How many left-out clips the NOTE line names: it must stay within the log tail the job record keeps.
NOTE_NAMED = 5
# The job record keeps a failed stage's last lines within 2,000 characters: the refusal after this line
# must still fit.
NOTE_MAX_CHARS = 800


class TooLittleSpeech(UnusableData):
    """Too little usable speech after preparation: the job is refused (exit 65), its report written."""


@dataclass
class Piece:
    """A clip of the prepared dataset to be: a recording, or one sentence of one."""

    uid: str
    source: Clip
    text: str
    audio: np.ndarray  # normalised, float32 at SAMPLE_RATE_HZ

    @property
    def seconds(self) -> float:
        return len(self.audio) / SAMPLE_RATE_HZ


@dataclass
class Outcome:
    kept: list[Piece] = field(default_factory=list)
    left_out: list[dict[str, Any]] = field(default_factory=list)

    def leave_out(self, uid: str, source: Clip, reason: tuple[str, str], seconds: float) -> None:
        code, detail = reason
        self.left_out.append({"id": uid, "source": source.index, "reason": code, "detail": detail,
                              "seconds": round(seconds, 2)})


@dataclass(frozen=True)
class Judges:
    """What preparation asks about a clip: its spoken phonemes, what a recogniser hears (None: no
    recogniser for the language) and its unit d-vector."""

    phonemes: Callable[[str], int]
    transcribe: Callable[[np.ndarray, str], tuple[float | None, str]] | None
    embed: Callable[[np.ndarray], np.ndarray]


def pieces_of(clip: Clip, profile: Profile, outcome: Outcome) -> list[Piece]:
    """The clip trimmed (and cut at its sentence pauses when too long), the pieces that pass the signal
    checks; the others go to ``outcome.left_out``."""
    import soundfile

    samples, rate_hz = soundfile.read(str(clip.wav_path), dtype="float32")
    if not clip.text.strip():
        outcome.leave_out(clip.uid, clip, ("blank_text", "the transcript is blank"), clip.duration_s)
        return []
    voiced = prep_audio.voicing(samples, rate_hz)
    whole = prep_audio.trimmed(voiced, 0, len(voiced.speech), rate_hz, len(samples))
    if whole is None:
        outcome.leave_out(clip.uid, clip, ("no_speech", "no frame of speech (webrtcvad)"), clip.duration_s)
        return []
    spans: list[tuple[str, str, int, int]] = [(clip.uid, clip.text, 0, len(voiced.speech))]
    if (whole[1] - whole[0]) / rate_hz > profile.max_clip_s:
        sentences = prep_rules.split_sentences(clip.text)
        found = prep_audio.pauses(voiced)
        cuts = prep_rules.cut_frames(found, len(sentences))
        if cuts is None:
            outcome.leave_out(clip.uid, clip, (
                "not_segmentable", f"{(whole[1] - whole[0]) / rate_hz:.1f} s, longer than {profile.max_clip_s:g} s,"
                f" and its {len(sentences)} sentence(s) do not match its {len(found)} pause(s) of at least"
                f" {prep_audio.MIN_PAUSE_S:g} s"), clip.duration_s)
            return []
        edges = [0, *cuts, len(voiced.speech)]
        spans = [(f"{clip.uid}-{n:02d}", sentence, edges[n], edges[n + 1])
                 for n, sentence in enumerate(sentences)]
    snr = prep_audio.snr_db(samples, voiced)
    pieces = []
    for uid, text, start, end in spans:
        bounds = prep_audio.trimmed(voiced, start, end, rate_hz, len(samples))
        if bounds is None:
            outcome.leave_out(uid, clip, ("no_speech", "no frame of speech (webrtcvad)"), 0.0)
            continue
        audio = samples[bounds[0]:bounds[1]]
        seconds = len(audio) / rate_hz
        reason = (prep_rules.duration_reason(seconds, profile.min_clip_s, profile.max_clip_s)
                  or prep_rules.signal_reason(prep_audio.clipped_fraction(audio), snr))
        if reason is not None:
            outcome.leave_out(uid, clip, reason, seconds)
            continue
        pieces.append(Piece(uid=uid, source=clip, text=text, audio=prep_audio.normalised(audio)))
    return pieces


def judge(pieces: list[Piece], judges: Judges, outcome: Outcome) -> dict[str, np.ndarray]:
    """The text checks (phonemes a second, the recogniser), then the d-vectors of the pieces that passed."""
    passed = []
    for piece in pieces:
        reason = prep_rules.phoneme_reason(judges.phonemes(piece.text), piece.seconds)
        if reason is None and judges.transcribe is not None:
            cer, heard = judges.transcribe(piece.audio, piece.text)
            reason = prep_rules.transcript_reason(cer, heard)
        if reason is not None:
            outcome.leave_out(piece.uid, piece.source, reason, piece.seconds)
            continue
        passed.append(piece)
    pieces[:] = passed
    return {piece.uid: judges.embed(piece.audio) for piece in pieces}


def speaker(embeddings: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, float], dict[str, str]]:
    """The centroid of the clips that are the speaker, every clip's cosine to it and the clips of another
    speaker. Each clip is judged by its cosine to the centroid of the others: in a small dataset a clip
    pulls a centroid it is part of towards itself (4 clips of one espeak-ng voice and 1 of another: 0.81
    to the centroid of all five, 0.69 to the centroid of the four)."""
    if not embeddings:
        return np.zeros(0), {}, {}
    total = np.sum(np.stack(list(embeddings.values())), axis=0)
    others = {uid: float(e @ unit(total - e)) if len(embeddings) > 1 else 1.0
              for uid, e in embeddings.items()}
    odd = prep_rules.other_speakers(others)
    centre = centroid([e for uid, e in embeddings.items() if uid not in odd])
    return centre, {uid: float(e @ centre) for uid, e in embeddings.items()}, odd


def write_prepared(out: Path, pieces: list[Piece]) -> None:
    """The prepared dataset as ``PACKED_NAME`` (metadata.csv and wavs/), unpacked into ``out`` at once."""
    import soundfile

    def pack(handle: IO[bytes]) -> None:
        with tarfile.open(fileobj=handle, mode="w") as archive:
            for piece in pieces:
                wav = io.BytesIO()
                soundfile.write(wav, piece.audio, SAMPLE_RATE_HZ, subtype="PCM_16", format="WAV")
                add(archive, f"{WAVS_DIR_NAME}/{piece.uid}.wav", wav.getvalue())
            rows = "".join(f"{p.uid}|{escape_text(p.text)}|{escape_text(p.text)}\n" for p in pieces)
            add(archive, METADATA_NAME, rows.encode("utf-8"))

    (out / METADATA_NAME).unlink(missing_ok=True)
    atomic_write(out / PACKED_NAME, pack)
    unpack_prepared(out)


def add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def report(profile: Profile, recordings: list[Clip], outcome: Outcome, refused: str | None) -> dict[str, Any]:
    by_reason: dict[str, int] = {}
    for entry in outcome.left_out:
        by_reason[entry["reason"]] = by_reason.get(entry["reason"], 0) + 1
    return {
        "version": REPORT_VERSION,
        "profile": profile.name,
        "minimum": {"speechS": profile.min_speech_s, "clips": profile.min_clips},
        "totals": {"recordings": len(recordings),
                   "recordingsS": round(sum(c.duration_s for c in recordings), 2),
                   "keptClips": len(outcome.kept),
                   "keptS": round(sum(p.seconds for p in outcome.kept), 2),
                   "leftOutClips": len(outcome.left_out),
                   "leftOutByReason": by_reason},
        "kept": [{"id": p.uid, "source": p.source.index, "seconds": round(p.seconds, 2)} for p in outcome.kept],
        "leftOut": outcome.left_out,
        "refused": refused,
    }


def note_line(outcome: Outcome) -> str:
    kept_s = sum(p.seconds for p in outcome.kept)
    named = "; ".join(f"{e['id']} ({e['reason']}: {e['detail']})" for e in outcome.left_out[:NOTE_NAMED])
    more = f"; and {len(outcome.left_out) - NOTE_NAMED} more" if len(outcome.left_out) > NOTE_NAMED else ""
    left = f", left out {len(outcome.left_out)}: {named}{more}" if outcome.left_out else ""
    return f"NOTE prepared {len(outcome.kept)} clip(s), {kept_s:.1f} s of speech{left}"[:NOTE_MAX_CHARS]


def prepare(recordings: list[Clip], out: Path, profile: Profile, judges: Judges,
            progress: Callable[[float], None]) -> tuple[Outcome, np.ndarray, dict[str, float]]:
    """Prepare the dataset's ``recordings`` (``dataset.read_recordings``) into ``out`` (metadata.csv, wavs/,
    report.json): the outcome, the speaker's centroid and every embedded clip's cosine to it. Too little
    speech left raises ``TooLittleSpeech`` once the report is written."""
    outcome = Outcome()
    pieces: list[Piece] = []
    for number, clip in enumerate(recordings, start=1):
        pieces.extend(pieces_of(clip, profile, outcome))
        progress(40 * number / len(recordings))
    embeddings = judge(pieces, judges, outcome)
    progress(90)
    centre, cosines, odd = speaker(embeddings)
    for piece in pieces:
        if piece.uid in odd:
            outcome.leave_out(piece.uid, piece.source, ("another_speaker", odd[piece.uid]), piece.seconds)
        else:
            outcome.kept.append(piece)
    outcome.kept.sort(key=lambda p: (p.source.index, p.uid))
    outcome.left_out.sort(key=lambda e: (e["source"], e["id"]))
    refused = prep_rules.shortfall(sum(p.seconds for p in outcome.kept), len(outcome.kept),
                                   profile.min_speech_s, profile.min_clips)
    write_prepared(out, outcome.kept)
    text = json.dumps(report(profile, recordings, outcome, refused), indent=1, ensure_ascii=False) + "\n"
    atomic_write(out / REPORT_NAME, lambda handle: handle.write(text.encode("utf-8")))
    print(note_line(outcome), flush=True)
    if refused is not None:
        raise TooLittleSpeech(f"too little usable speech: {refused} ({len(outcome.left_out)} clip(s) left out,"
                              f" reasons in {REPORT_NAME})")
    return outcome, centre, cosines
