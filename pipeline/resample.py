"""Band-limited resampling (Kaiser-windowed sinc, polyphase), fed block by block.

``Resampler`` keeps only the input the next outputs still need, so converting a recording takes
memory for one block, not for the whole recording; ``resample`` is the one-shot form. Fed in any
split, the stream gives the same samples as one call over the whole input.
"""

from __future__ import annotations

import math

import numpy as np

# 16 zero crossings each side, Kaiser beta 8 (about 80 dB stop band), pass band to 94.5 % of the
# lower Nyquist frequency, at most 4096 filter phases for awkward rate ratios.
_ZERO_CROSSINGS = 16
_KAISER_BETA = 8.0
_ROLLOFF = 0.945
_MAX_PHASES = 4096
# Outputs computed at once are sized so each (outputs x taps) array stays near 2 MB: at 192 kHz in,
# the filter has about 300 taps.
_CHUNK_ELEMENTS = 1 << 18
# The most outputs one ``feed`` of ``max_feed`` inputs can give (2 MB as float64), whatever the ratio.
_MAX_OUT_PER_FEED = 1 << 18


class Resampler:
    """Converts a stream of float samples from ``from_hz`` to ``to_hz``: ``feed`` blocks, then ``finish``."""

    def __init__(self, from_hz: int, to_hz: int):
        self._identity = from_hz == to_hz
        g = math.gcd(from_hz, to_hz)
        self.up, self.down = to_hz // g, from_hz // g
        # Cut-off in cycles per input sample: below the lower of the two Nyquist frequencies.
        cutoff = 0.5 * min(1.0, self.up / self.down) * _ROLLOFF
        half_width = _ZERO_CROSSINGS / (2.0 * cutoff)
        self._k = k = int(math.ceil(half_width))
        self._offsets = np.arange(-k + 1, k + 1)
        self._phases = min(self.up, _MAX_PHASES)
        frac = np.arange(self._phases) / self._phases
        distance = self._offsets[None, :] - frac[:, None]
        self._table = 2.0 * cutoff * np.sinc(2.0 * cutoff * distance) * _kaiser(distance / half_width)
        self._chunk = max(1, _CHUNK_ELEMENTS // len(self._offsets))
        # Feeding at most this many inputs at once bounds what one feed returns.
        self.max_feed = max(1, _MAX_OUT_PER_FEED * self.down // self.up)
        # Input before the first sample counts as silence; _buffer[0] is input index _buffer_start.
        self._buffer = np.zeros(k)
        self._buffer_start = -k
        self._n_in = 0
        self._next_out = 0

    def feed(self, block: np.ndarray) -> np.ndarray:
        """The outputs that ``block`` completes (every input they depend on has arrived)."""
        x = np.asarray(block, dtype=np.float64)
        if self._identity:
            return x.copy()
        self._buffer = np.concatenate([self._buffer, x])
        self._n_in += len(x)
        # Output n reads inputs up to base(n) + k + 1 (the +1 for the phase rounding's carry).
        last_base = self._n_in - self._k - 2
        ready = (last_base * self.up + self.up - 1) // self.down + 1 if last_base >= 0 else 0
        return self._emit(max(ready, self._next_out))

    def finish(self) -> np.ndarray:
        """The remaining outputs, reading silence past the end of the input."""
        if self._identity:
            return np.zeros(0)
        self._buffer = np.concatenate([self._buffer, np.zeros(self._k + 2)])
        return self._emit(-(-self._n_in * self.up // self.down))

    def _emit(self, end: int) -> np.ndarray:
        up, down = self.up, self.down
        out = np.empty(end - self._next_out)
        for start in range(self._next_out, end, self._chunk):
            n = np.arange(start, min(start + self._chunk, end), dtype=np.int64)
            numerator = n * down
            base = numerator // up
            if self._phases == up:
                phase = numerator % up
            else:
                phase = np.rint((numerator % up) * (self._phases / up)).astype(np.int64)
                carry = phase == self._phases
                base = base + carry
                phase[carry] = 0
            taps = self._buffer[(base - self._buffer_start)[:, None] + self._offsets[None, :]]
            out[start - self._next_out : start - self._next_out + len(n)] = np.einsum(
                "ij,ij->i", taps, self._table[phase]
            )
        self._next_out = end
        # Drop the input no later output can reach: the next one starts at base(next) - k + 1.
        keep_from = self._next_out * down // up - self._k + 1
        drop = keep_from - self._buffer_start
        if drop > 0:
            self._buffer = self._buffer[drop:]
            self._buffer_start += drop
        return out


def resample(samples: np.ndarray, from_hz: int, to_hz: int) -> np.ndarray:
    """Band-limited resampling of a whole signal at once."""
    stream = Resampler(from_hz, to_hz)
    return np.concatenate([stream.feed(samples), stream.finish()])


def _kaiser(u: np.ndarray) -> np.ndarray:
    inside = np.abs(u) <= 1.0
    arg = np.sqrt(np.clip(1.0 - u * u, 0.0, None))
    return np.where(inside, np.i0(_KAISER_BETA * arg) / np.i0(_KAISER_BETA), 0.0)
