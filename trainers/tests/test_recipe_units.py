"""The training recipe's pure decisions: batches, the held-out split, the schedule, the score, METRIC lines,
autocast and the lost device, without a model (fakes where torch would run).

    cd trainers && .venv/bin/python -m pytest -q tests/test_recipe_units.py
"""

from __future__ import annotations

import contextlib
import math
import re
from types import SimpleNamespace

import pytest
import torch
from voice_trainers.batching import WINDOW_BATCHES, EpochBatches, epoch_batches, held_out_split
from voice_trainers.device import HostUnfit
from voice_trainers.loop import Precision, Run, device_lost, metric_line, should_freeze_text_encoder, train
from voice_trainers.profiles import PROFILES
from voice_trainers.schedule import lr_factor, set_learning_rates, warmup_steps
from voice_trainers.validation import SIMILARITY_WEIGHT, validation_score

METRIC = re.compile(r"METRIC step=(\d+)((?: [A-Za-z][A-Za-z0-9_.]{0,47}=\S+)+)")


def lengths(count: int) -> list[float]:
    """Clip lengths all different, in a scrambled order (the loader's order is by length already; this is not)."""
    return [float((i * 37) % count + 1) for i in range(count)]


def test_the_order_of_batches_differs_from_one_epoch_to_the_next():
    """Two epochs of the same seed cut other batches in another order, and every clip comes once per epoch."""
    first, second = (epoch_batches(lengths(200), 4, seed=7, epoch=e) for e in (0, 1))
    assert first != second
    assert {frozenset(b) for b in first} != {frozenset(b) for b in second}
    for batches in (first, second):
        assert sorted(i for batch in batches for i in batch) == list(range(200))


def test_each_batch_holds_clips_of_similar_length():
    """A batch's clips lie within one window of neighbouring lengths: 5 batches' worth of the 200 ranks."""
    sizes = lengths(200)
    rank = {i: r for r, i in enumerate(sorted(range(200), key=lambda i: sizes[i]))}
    for epoch in range(5):
        for batch in epoch_batches(sizes, 4, seed=7, epoch=epoch):
            ranks = [rank[i] for i in batch]
            assert max(ranks) - min(ranks) < 4 * WINDOW_BATCHES


def test_the_same_seed_and_epoch_give_the_same_batches_and_a_resume_skips_those_trained():
    """Resumed at global step 57 with 50 batches an epoch, the sampler goes on with epoch 1's eighth batch."""
    sampler = EpochBatches(lengths(200), 4, seed=7)
    assert sampler.batches_per_epoch() == 50
    sampler.start(57)
    assert len(sampler) == 43
    assert list(sampler) == epoch_batches(lengths(200), 4, seed=7, epoch=1)[7:]
    assert list(sampler) == epoch_batches(lengths(200), 4, seed=7, epoch=2)
    assert epoch_batches(lengths(200), 4, seed=8, epoch=1) != epoch_batches(lengths(200), 4, seed=7, epoch=1)


def test_every_epoch_has_as_many_batches_and_only_the_last_is_short():
    """With 203 clips in batches of 4: 51 batches every epoch, one of 3 clips."""
    for epoch in range(10):
        batches = epoch_batches(lengths(203), 4, seed=1, epoch=epoch)
        assert len(batches) == 51 and sorted(len(b) for b in batches)[0] == 3


@pytest.mark.parametrize(("count", "min_train", "held"), [(100, 10, 10), (30, 10, 5), (200, 50, 20), (12, 10, 2)])
def test_the_held_out_set_is_5_clips_or_10_percent_whichever_is_larger_keeping_the_minimum(count, min_train, held):
    """max(5, 10 %) are held out, fewer when training would keep under the profile's minimum."""
    split = held_out_split([f"utt{i:05d}" for i in range(count)], min_train)
    assert len(split.held_out) == held and len(split.train) == count - held
    assert set(split.held_out).isdisjoint(split.train)
    assert (split.note is None) == (held == max(5, -(-count // 10)))


def test_too_few_clips_hold_none_out_and_say_the_last_step_ships_unvalidated():
    """With exactly the minimum, every clip trains and the note says so."""
    split = held_out_split([f"utt{i:05d}" for i in range(10)], 10)
    assert split.held_out == [] and split.train == list(range(10))
    assert split.note == ("no clip held out for validation: 10 clips and at least 10 must train;"
                          " the last step is shipped, unvalidated")


def test_the_held_out_clips_follow_the_ids_not_their_order():
    """The same clip ids are held out whatever the order of the metadata."""
    uids = [f"utt{i:05d}" for i in range(60)]
    reordered = list(reversed(uids))
    chosen = {uids[i] for i in held_out_split(uids, 10).held_out}
    assert chosen == {reordered[i] for i in held_out_split(reordered, 10).held_out}
    assert len(chosen) == 6 and chosen != set(uids[:6])


def test_the_learning_rate_warms_up_then_ends_at_a_tenth_of_the_peak():
    """Production's fine-tune: 300 warm-up steps to the peak, then down to 10 % at the last of 15,000 steps."""
    profile = PROFILES["production"]
    total = profile.fine_tune_steps
    factors = [lr_factor(s, total, profile.warmup_fraction, profile.final_lr_fraction) for s in range(total)]
    assert warmup_steps(total, profile.warmup_fraction) == 300
    assert factors[0] == pytest.approx(1 / 300) and factors[299] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[299:], factors[300:], strict=False))
    assert factors[-1] == pytest.approx(0.1)
    halfway = (total // 2 + 1 - 300) / (total - 300)
    assert factors[total // 2] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * halfway)))


def test_a_resumed_run_sets_the_same_learning_rate_as_an_uninterrupted_one():
    """The rate is a function of the step: optimizers built afresh at step 4,321 get the rate of that step."""
    profile = PROFILES["production"]
    model = torch.nn.Linear(2, 2)
    fresh = [torch.optim.AdamW(model.parameters(), lr=1.0), torch.optim.AdamW(model.parameters(), lr=1.0)]
    factor = lr_factor(4321, 15_000, profile.warmup_fraction, profile.final_lr_fraction)
    rates = set_learning_rates(fresh, [1e-4, 2e-4], factor)
    assert rates == [pytest.approx(1e-4 * factor), pytest.approx(2e-4 * factor)]
    assert [o.param_groups[0]["lr"] for o in fresh] == rates


def test_the_validation_score_is_the_mel_distance_plus_the_weighted_similarity_lost():
    """Lower is better: a closer spectrum or a voice closer to the speaker both lower it."""
    assert validation_score({"val_mel_l1": 0.5, "val_speaker_similarity": 0.8}, 10) == \
        pytest.approx(0.5 + SIMILARITY_WEIGHT * 0.2)
    worse = validation_score({"val_mel_l1": 0.5, "val_speaker_similarity": 0.7}, 10)
    assert worse > validation_score({"val_mel_l1": 0.5, "val_speaker_similarity": 0.8}, 10)


def test_metric_lines_have_the_agreed_shape_and_drop_non_finite_values():
    """``METRIC step=N name=value``: NaN and infinities are left out, never more than 16 pairs."""
    line = metric_line(12, {"loss_mel": 21.5, "loss_kl": float("nan"), "lr": 1.5e-4, "val_x": float("inf")})
    assert line == "METRIC step=12 loss_mel=21.5 lr=0.00015"
    assert METRIC.fullmatch(line)
    many = metric_line(1, {f"m{i}": float(i) for i in range(20)})
    assert METRIC.fullmatch(many) and len(many.split()) == 2 + 16


def test_only_a_fine_tune_on_little_speech_freezes_the_text_encoder():
    """From scratch never (the encoder would stay random); a fine-tune below the profile's threshold does."""
    profile = PROFILES["production"]
    assert should_freeze_text_encoder(True, 300.0, profile)
    assert not should_freeze_text_encoder(True, 900.0, profile)
    assert not should_freeze_text_encoder(False, 300.0, profile)


class FakeTorch:
    """What Precision asks of torch: which autocasts it requested."""

    bfloat16 = "bf16"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def autocast(self, **kwargs):
        self.calls.append(kwargs)
        return contextlib.nullcontext()


def test_autocast_is_bf16_on_cuda_and_absent_on_the_cpu():
    """On CUDA the forward runs under bf16 autocast and the spectrograms under a disabled one; on the CPU no
    autocast at all around the forward."""
    cuda = FakeTorch()
    with Precision(cuda, "cuda").forward(), Precision(cuda, "cuda").fp32():
        pass
    assert cuda.calls == [{"device_type": "cuda", "dtype": "bf16"}, {"device_type": "cuda", "enabled": False}]
    cpu = FakeTorch()
    with Precision(cpu, "cpu").forward():
        pass
    assert cpu.calls == []


@pytest.mark.parametrize(("error", "lost"), [
    (RuntimeError("CUDA error: unspecified launch failure"), True),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), True),
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
     if hasattr(torch, "AcceleratorError") else RuntimeError("CUDA error: an illegal memory access"), True),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    # The type decides too, whatever another torch's message says.
    (torch.cuda.OutOfMemoryError("CUDA error: allocation of 2.00 GiB failed"), False),
    (RuntimeError("CUDA error: device-side assert triggered"), False),
    (RuntimeError("Expected all tensors to be on the same device, cuda:0 and cpu"), False),
    (ValueError("CUDA"), False),
])
def test_which_errors_mean_the_device_is_gone(error, lost):
    """Errors naming CUDA are a lost device, except running out of memory and an assert inside a kernel."""
    assert device_lost(error, torch) is lost


class FailingModel:
    """A model whose first training step fails the way a GPU falling off the bus does."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.disc = torch.nn.Linear(1, 1)

    def train(self) -> None:
        pass

    def named_parameters(self):
        return self.disc.named_parameters(prefix="disc")

    def format_batch(self, batch):
        return batch

    def format_batch_on_device(self, batch):
        return batch

    def train_step(self, batch, criterion, index):
        raise self.error


def fake_run(error: BaseException, device_type: str, *, available: bool = True) -> Run:
    fake_torch = SimpleNamespace(
        is_tensor=torch.is_tensor, nn=torch.nn, cuda=SimpleNamespace(
            OutOfMemoryError=torch.cuda.OutOfMemoryError, is_available=lambda: available,
            synchronize=lambda: None),
        autocast=lambda **kwargs: contextlib.nullcontext(), bfloat16=torch.bfloat16)
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    return Run(model=FailingModel(error), loader=[{}], sampler=SimpleNamespace(start=lambda step: None),
               optimizers=[optimizer, optimizer], criteria=[None, None],
               config=SimpleNamespace(grad_clip=[1, 1]), profile=PROFILES["ci"], fingerprint="f" * 64,
               checkpoints=None, signals=None, torch=fake_torch, device=SimpleNamespace(type=device_type),
               peak_lrs=[1e-4, 1e-4], measure=None, best_score=None, save_checkpoint=lambda step: None)


def test_a_cuda_device_lost_mid_run_is_host_unfit_never_a_cpu_continuation():
    """The stage ends with HostUnfit (exit 70) naming the error, rather than training on."""
    with pytest.raises(HostUnfit, match=r"^the CUDA device was lost during training \(RuntimeError: CUDA error:"
                                        r" unspecified launch failure\); not going on on the CPU$"):
        train(fake_run(RuntimeError("CUDA error: unspecified launch failure"), "cuda"), 3)


def test_cuda_no_longer_available_after_an_error_is_host_unfit():
    """Whatever the message, an error after which CUDA has no device is the host's fault."""
    with pytest.raises(HostUnfit):
        train(fake_run(RuntimeError("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"), "cuda", available=False), 3)


@pytest.mark.parametrize(("error", "device_type"), [
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "cuda"),
    (RuntimeError("CUDA error: unspecified launch failure"), "cpu"),
])
def test_running_out_of_memory_and_errors_off_cuda_stay_crashes_the_worker_retries(error, device_type):
    """Out of memory on CUDA, or any error of a CPU run, is raised as it is (exit 1, retried), not exit 70."""
    with pytest.raises(type(error)) as raised:
        train(fake_run(error, device_type), 3)
    assert raised.value is error
