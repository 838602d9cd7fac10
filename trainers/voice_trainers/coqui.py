"""Coqui VITS set-up shared by the full and light stages (imports torch and Coqui: call only from a stage)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from voice_trainers.dataset import SAMPLE_RATE_HZ
from voice_trainers.profiles import Profile
from voice_trainers.threads import torch_threads

# Coqui's model keys the exported full model keeps; the discriminator only matters for training.
DISCRIMINATOR_PREFIX = "disc."
# The duration predictor's noise at inference, for the full model (its config) and the light one (Piper's
# noise_w, read from that config): Piper's usual 0.8 rather than Coqui's 1.0, and the same in both.
NOISE_SCALE_DP = 0.8


def import_torch() -> Any:
    """torch, with its intra-op threads taken from OMP_NUM_THREADS."""
    import torch

    threads = torch_threads(os.environ)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch


def patch_audio_loader() -> None:
    """Read WAVs with soundfile: Coqui's torchaudio.load goes through torchcodec, which needs CUDA's libnvrtc.

    The worker always writes 22,050 Hz mono 16-bit PCM, so no resampling or mixing is needed.
    """
    import soundfile
    import torch
    from TTS.tts.models import vits

    def load_audio(file_path: str) -> tuple[Any, int]:
        samples, rate_hz = soundfile.read(file_path, dtype="float32", always_2d=True)
        return torch.from_numpy(samples.T.copy()), rate_hz

    vits.load_audio = load_audio


def piper_characters() -> Any:
    """A from-scratch model's vocabulary: Coqui's four special tokens, then Piper's symbols in Piper's order.

    Piper's set holds what its espeak-ng writes (tone digits, combining marks, ``;``), which Coqui's default
    ``IPAPhonemes`` lacks. Explicitly unique and unsorted: Coqui's ``is_unique`` goes through a set, whose
    order changes from process to process.
    """
    from TTS.tts.configs.shared_configs import CharactersConfig

    from voice_trainers.tokenizer import piper_symbols

    return CharactersConfig(characters_class="TTS.tts.utils.text.characters.IPAPhonemes", pad="<PAD>",
                            eos="<EOS>", bos="<BOS>", blank="<BLNK>", characters="".join(piper_symbols()),
                            punctuations="", is_unique=False, is_sorted=False)


def build_config(profile: Profile, voice: str, *, phoneme_cache: Path | None) -> Any:
    warnings.filterwarnings("ignore", category=FutureWarning)
    from TTS.config.shared_configs import BaseAudioConfig
    from TTS.tts.configs.vits_config import VitsArgs, VitsConfig

    from voice_trainers.tokenizer import PHONEMIZER_NAME, register

    register()
    audio = BaseAudioConfig(sample_rate=SAMPLE_RATE_HZ, fft_size=1024, win_length=1024, hop_length=256,
                            num_mels=80, mel_fmin=0.0, mel_fmax=None)
    return VitsConfig(
        model_args=VitsArgs(**{"inference_noise_scale_dp": NOISE_SCALE_DP, **profile.model_args}),
        audio=audio,
        run_name="voice",
        batch_size=profile.batch_size,
        eval_batch_size=profile.batch_size,
        batch_group_size=0,
        num_loader_workers=0,
        num_eval_loader_workers=0,
        run_eval=False,
        test_delay_epochs=-1,
        mixed_precision=False,
        # The text goes through voice_trainers.normalise and Piper's phonemizer (voice_trainers.tokenizer),
        # not through a Coqui cleaner Piper would not apply at inference.
        text_cleaner=None,
        characters=piper_characters(),
        use_phonemes=True,
        phonemizer=PHONEMIZER_NAME,
        phoneme_language=voice,
        compute_input_seq_cache=True,
        phoneme_cache_path=str(phoneme_cache) if phoneme_cache is not None else None,
        min_audio_len=1,
        max_audio_len=int(profile.max_clip_s * SAMPLE_RATE_HZ) + 1,
        min_text_len=1,
        max_text_len=10_000,
        output_path="",
        datasets=[],
        test_sentences=[],
        print_step=1,
        save_step=profile.checkpoint_every_steps,
        epochs=1,
    )


def portable_config(config: Any) -> dict[str, Any]:
    """The config as a dict with no path of this job in it: config.json travels with the model."""
    data = config.to_dict()
    data["output_path"] = ""
    data["phoneme_cache_path"] = None
    data["datasets"] = []
    return data


def parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())
