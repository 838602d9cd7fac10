"""The decisions of data preparation, as small pure functions (docs/trainer.md, "Data preparation").

Each returns a reason a clip is left out (a code of ``REASONS`` and a line for a person) or None.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

# The reasons a recording or a piece of one is left out (the report's ``leftOut[].reason``).
REASONS = ("blank_text", "no_speech", "not_segmentable", "too_short", "too_long", "clipped", "noisy",
           "phoneme_rate", "transcript_mismatch", "another_speaker")
# More than 0.1 % of samples at full scale: the recording clipped (a peak-normalised clean recording has
# a handful of such samples; clipping has runs of them).
MAX_CLIPPED_FRACTION = 0.001
# Speech frames' power over the pauses' power: below 15 dB the noise is plainly audible and VITS learns it.
MIN_SNR_DB = 15.0
# Spoken phonemes (espeak-ng's, as the trainer's tokenizer gives them) per second of the trimmed clip:
# conversational speech runs at 10-15, fast read speech near 20 (espeak-ng at 150 words a minute: 12-14).
# Outside these bounds the text is not what the clip says (a missing or an extra sentence).
MIN_PHONEMES_PER_S = 4.0
MAX_PHONEMES_PER_S = 30.0
# pocketsphinx's en-us model heard correct texts of espeak-ng speech at a CER of 0.26-0.77 (16 clips) and
# other clips' texts at 0.64-1.5: only a CER beyond this is a disagreement strong enough to act on.
MAX_TRANSCRIPT_CER = 0.9
# Another speaker: a cosine to the centroid this far below the median of the clips' cosines (espeak-ng:
# one voice 0.94-0.97 to its own centroid, a female variant 0.67-0.71). The margin widens with the
# spread of the clips (MAD_FACTOR median absolute deviations) so a varied speaker is not thinned out.
SPEAKER_MARGIN = 0.12
MAD_FACTOR = 4.0
# Below this many clips a centroid says little about who the speaker is: nobody is left out for it.
MIN_CLIPS_FOR_SPEAKER = 3
# Pauses chosen as sentence ends must be this much longer than the longest pause not chosen.
PAUSE_SEPARATION = 1.5

_END_MARKS = ".!?\u2026\u3002\uff01\uff1f"
_CLOSERS = "\"'\u201d\u2019)]"


def split_sentences(text: str) -> list[str]:
    """The text's sentences: a word ending in ``.`` ``!`` ``?`` ``…`` (or a CJK full stop), closing quotes
    and brackets aside, ends one."""
    sentences: list[str] = []
    words: list[str] = []
    for word in text.split():
        words.append(word)
        if word.rstrip(_CLOSERS)[-1:] in tuple(_END_MARKS):
            sentences.append(" ".join(words))
            words = []
    if words:
        sentences.append(" ".join(words))
    return sentences


def cut_frames(pauses: Sequence[tuple[int, float]], sentences: int) -> list[int] | None:
    """Where to cut a recording of ``sentences`` sentences: at its ``sentences - 1`` longest pauses, in
    order, when it has exactly that many, or more but with those clearly the longest
    (``PAUSE_SEPARATION``); None when the pauses and the sentences do not match (the text could not
    follow the audio)."""
    wanted = sentences - 1
    if wanted < 1 or len(pauses) < wanted:
        return None
    ranked = sorted(pauses, key=lambda pause: pause[1], reverse=True)
    if len(ranked) > wanted and ranked[wanted - 1][1] < PAUSE_SEPARATION * ranked[wanted][1]:
        return None
    return sorted(frame for frame, _ in ranked[:wanted])


def duration_reason(seconds: float, min_s: float, max_s: float) -> tuple[str, str] | None:
    if seconds < min_s:
        return "too_short", f"{seconds:.2f} s of speech, shorter than {min_s:g} s"
    if seconds > max_s:
        return "too_long", f"{seconds:.1f} s after trimming, longer than {max_s:g} s"
    return None


def signal_reason(clipped: float, snr_db: float | None) -> tuple[str, str] | None:
    if clipped > MAX_CLIPPED_FRACTION:
        return "clipped", f"{100 * clipped:.2f} % of samples at full scale (at most {100 * MAX_CLIPPED_FRACTION:g} %)"
    if snr_db is not None and snr_db < MIN_SNR_DB:
        return "noisy", f"speech {snr_db:.1f} dB over the pauses' noise (at least {MIN_SNR_DB:g} dB)"
    return None


def phoneme_reason(phonemes: int, seconds: float) -> tuple[str, str] | None:
    rate = phonemes / seconds if seconds > 0 else float("inf")
    if not MIN_PHONEMES_PER_S <= rate <= MAX_PHONEMES_PER_S:
        return "phoneme_rate", (f"{phonemes} phonemes in {seconds:.1f} s ({rate:.1f} a second, plausible"
                                f" {MIN_PHONEMES_PER_S:g}-{MAX_PHONEMES_PER_S:g})")
    return None


def transcript_reason(cer: float | None, heard: str) -> tuple[str, str] | None:
    if cer is not None and cer > MAX_TRANSCRIPT_CER:
        return "transcript_mismatch", f"the recogniser heard {heard[:80]!r}: CER {cer:.2f} > {MAX_TRANSCRIPT_CER:g}"
    return None


def speaker_floor(cosines: Sequence[float]) -> float | None:
    """The cosine below which a clip is another speaker's, or None when there are too few clips to say."""
    if len(cosines) < MIN_CLIPS_FOR_SPEAKER:
        return None
    median = statistics.median(cosines)
    mad = statistics.median(abs(c - median) for c in cosines)
    return median - max(SPEAKER_MARGIN, MAD_FACTOR * mad)


def other_speakers(cosines: Mapping[str, float]) -> dict[str, str]:
    """The clips far below the others in cosine (each to the centroid of the other clips), with their line."""
    floor = speaker_floor(list(cosines.values()))
    if floor is None:
        return {}
    return {uid: f"cosine {value:.2f} to the other clips' centroid, below {floor:.2f} (the clips' median"
                 f" {statistics.median(cosines.values()):.2f})"
            for uid, value in cosines.items() if value < floor}


def shortfall(kept_s: float, kept_clips: int, min_speech_s: float, min_clips: int) -> str | None:
    """Why the kept clips are too little to train on (None: enough)."""
    missing = []
    if kept_s < min_speech_s:
        missing.append(f"{kept_s:.1f} s of speech, at least {min_speech_s:g} s needed")
    if kept_clips < min_clips:
        missing.append(f"{kept_clips} clips, at least {min_clips} needed")
    return "; ".join(missing) or None
