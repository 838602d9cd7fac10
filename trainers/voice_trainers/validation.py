"""Validation of the full stage on its held-out clips, and the one score that picks the checkpoint shipped.

Every ``validate_every_steps`` and at the last step the model speaks each held-out clip's text (a fixed
noise seed, so two checkpoints differ by their weights only) and is measured against the clip:

- ``val_mel_l1``: the mean absolute difference of the natural-log mel spectrograms (Coqui's, 80 bands, the
  training loss's own), the synthesis stretched linearly in time to the recording's length first, since its
  durations are the model's own;
- ``val_speaker_similarity``: the cosine of the syntheses' Resemblyzer d-vectors to the centroid of the
  training recordings (the evaluate stage's scorer, scoring/similarity.py).

``validation_score`` (lower is better) = ``val_mel_l1 + SIMILARITY_WEIGHT * (1 - val_speaker_similarity)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

# One unit of similarity (a cosine) weighs as much as one unit of log-mel L1 (a natural-log ratio): a
# checkpoint that drifts off the speaker by 0.05 must be 0.05 closer in spectrum to win. To be confirmed on a
# GPU run (docs/trainer.md lists it), where the spread of either across checkpoints is measured.
SIMILARITY_WEIGHT = 1.0
# The noise the model draws while speaking (the flow's and the duration predictor's) is seeded with this.
VALIDATION_SEED = 1234
# How many training recordings make the speaker's centroid: the evaluate stage's reference count.
REFERENCE_CLIPS = 8

Measure = Callable[[Any], dict[str, float]]
Score = Callable[[Mapping[str, float], int], float]


def validation_score(metrics: Mapping[str, float], step: int) -> float:
    """The stated rule: lower is better (``step`` is there for injected rules; this one ignores it)."""
    return metrics["val_mel_l1"] + SIMILARITY_WEIGHT * (1.0 - metrics["val_speaker_similarity"])


def spread(items: Sequence[Any], count: int) -> list[Any]:
    """``count`` items evenly spread over the sequence (all of them when there are fewer)."""
    if len(items) <= count:
        return list(items)
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)] if count > 1 else [items[0]]


class HeldOut:
    """The held-out clips' token ids and log-mels, and the speaker's centroid, computed once per run."""

    def __init__(self, model: Any, config: Any, held_out: list[dict[str, Any]], references: list[str],
                 torch: Any, device: Any) -> None:
        from voice_trainers.scoring.similarity import SpeakerEncoder, centroid

        self.torch, self.device, self.config = torch, device, config
        self.items: list[tuple[Any, Any, str]] = []
        loader = model.get_data_loader(config, is_eval=True, samples=held_out, verbose=False)
        with torch.autocast(device_type=device.type, enabled=False):
            for batch in loader:
                batch = model.format_batch(batch)
                batch = model.format_batch_on_device(batch)
                for i in range(len(batch["token_lens"])):
                    tokens = batch["tokens"][i, : int(batch["token_lens"][i])].clone()
                    mel = batch["mel"][i, :, : int(batch["mel_lens"][i])].float().clone()
                    self.items.append((tokens, mel, batch["raw_text"][i]))
        self.encoder = SpeakerEncoder()
        self.centroid = centroid([self.encoder.embed(_read(path)) for path in spread(references, REFERENCE_CLIPS)])

    def __call__(self, model: Any) -> dict[str, float]:
        from TTS.utils.audio.torch_transforms import wav_to_mel

        from voice_trainers.scoring.audio import Utterance
        from voice_trainers.scoring.similarity import mean_cosine

        torch, audio = self.torch, self.config.audio
        was_training = model.training
        model.eval()
        distances, embeddings = [], []
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.autocast(device_type=self.device.type, enabled=False):
                torch.manual_seed(VALIDATION_SEED)
                for tokens, mel, text in self.items:
                    x = tokens.unsqueeze(0).to(self.device)
                    aux = {"x_lengths": torch.tensor([x.shape[1]], device=self.device), "d_vectors": None,
                           "speaker_ids": None, "language_ids": None, "durations": None}
                    wav = model.inference(x, aux_input=aux)["model_outputs"].float().reshape(1, 1, -1)
                    # A synthesis shorter than one analysis window still gets a frame to compare.
                    wav = torch.nn.functional.pad(wav, (0, max(0, audio.fft_size - wav.shape[-1])))
                    spoken = wav_to_mel(y=wav, n_fft=audio.fft_size, num_mels=audio.num_mels,
                                        sample_rate=audio.sample_rate, hop_length=audio.hop_length,
                                        win_length=audio.win_length, fmin=audio.mel_fmin, fmax=audio.mel_fmax,
                                        center=False)
                    distances.append(mel_l1(torch, spoken[0].cpu(), mel))
                    samples = wav.reshape(-1).cpu().numpy()
                    embeddings.append(self.encoder.embed(Utterance(samples, audio.sample_rate, text)))
        finally:
            model.train(was_training)
        return {"val_mel_l1": float(np.mean(distances)),
                "val_speaker_similarity": mean_cosine(embeddings, self.centroid)}


def mel_l1(torch: Any, spoken: Any, recorded: Any) -> float:
    """Mean |log-mel difference| after stretching the synthesis (bands x frames) to the recording's frames."""
    stretched = torch.nn.functional.interpolate(spoken.unsqueeze(0), size=recorded.shape[-1], mode="linear",
                                                align_corners=False)[0]
    return float((stretched - recorded).abs().mean())


def _read(path: str) -> Any:
    import soundfile

    from voice_trainers.scoring.audio import Utterance

    samples, rate_hz = soundfile.read(path, dtype="float32", always_2d=True)
    return Utterance(samples.mean(axis=1), rate_hz, "")
