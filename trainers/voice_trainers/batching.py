"""Which clips train and which are held out, and in which batches the training clips come each epoch.

Pure and torch-free: the loader takes ``EpochBatches`` as its batch sampler, the stage calls ``held_out_split``.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# Piper holds out 10 % of a dataset for validation; fewer than 5 clips make a score that one odd clip swings.
HELD_OUT_FRACTION = 0.1
HELD_OUT_AT_LEAST = 5
# Batches are cut from windows of this many batches' worth of clips of neighbouring lengths, shuffled within
# the window: Coqui's VITS recipe sets batch_group_size=5. A batch is padded to its longest clip, so similar
# lengths waste little compute; a window wider than one batch still lets a clip meet other partners each epoch.
WINDOW_BATCHES = 5


@dataclass(frozen=True)
class Split:
    train: list[int]
    held_out: list[int]
    note: str | None


def held_out_split(uids: Sequence[str], min_train: int) -> Split:
    """Indices of the clips that train and of those held out for validation, chosen by a hash of the clip ids.

    ``max(5, 10 %)`` clips are held out, fewer when training would keep under ``min_train`` clips; when not
    even one can be spared, none is, and the note says the stage ships its last step unvalidated.
    The hash, not the order, decides: the same clips stay out on every retry of the job and whatever the
    order of the metadata.
    """
    wanted = max(HELD_OUT_AT_LEAST, math.ceil(HELD_OUT_FRACTION * len(uids)))
    count = max(0, min(wanted, len(uids) - min_train))
    ranked = sorted(range(len(uids)), key=lambda i: (hashlib.sha256(uids[i].encode()).hexdigest(), i))
    held = sorted(ranked[:count])
    train = [i for i in range(len(uids)) if i not in set(held)]
    note = None
    if count == 0:
        note = (f"no clip held out for validation: {len(uids)} clips and at least {min_train} must train;"
                f" the last step is shipped, unvalidated")
    elif count < wanted:
        note = (f"only {count} clip(s) held out for validation (of the {wanted} wanted), so that {min_train}"
                f" train: the validation score is noisier")
    return Split(train=train, held_out=held, note=note)


def epoch_batches(lengths: Sequence[float], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """This epoch's batches: clips of neighbouring lengths together, the windows and batches reshuffled.

    The same seed and epoch give the same batches, so a resumed run goes on with the very order it left.
    """
    rng = random.Random(f"{seed}:{epoch}")
    # Ties in length are broken at random, so equal-length clips do not always share a batch.
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    window = batch_size * WINDOW_BATCHES
    # The windows' edges move each epoch too, or two clips either side of an edge would never meet; they stay
    # on multiples of the batch size, so only the epoch's last batch is short and every epoch has as many.
    first = batch_size * rng.randint(1, WINDOW_BATCHES)
    edges = [0, *range(first, len(order), window), len(order)]
    batches = []
    for start, end in zip(edges, edges[1:], strict=False):
        group = order[start:end]
        rng.shuffle(group)
        batches.extend(group[cut:cut + batch_size] for cut in range(0, len(group), batch_size))
    rng.shuffle(batches)
    return [batch for batch in batches if batch]


class EpochBatches:
    """A batch sampler over ``epoch_batches``: each pass is the next epoch, the first may skip some batches.

    ``start(step)`` places it at a global step, so that a resumed run skips the batches already trained on.
    """

    def __init__(self, lengths: Sequence[float], batch_size: int, seed: int) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.skip = 0

    def batches_per_epoch(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)

    def start(self, step: int) -> None:
        self.epoch, self.skip = divmod(step, self.batches_per_epoch())

    def __len__(self) -> int:
        return self.batches_per_epoch() - self.skip

    def __iter__(self) -> Iterator[list[int]]:
        batches = epoch_batches(self.lengths, self.batch_size, self.seed, self.epoch)[self.skip:]
        self.epoch, self.skip = self.epoch + 1, 0
        yield from batches
