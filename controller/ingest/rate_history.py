"""Per-model request-rate samples in memory, at a fixed resolution, for the policy.

`RateHistory` is what the policy loop's signals and forecasts read; it is bounded
(`HISTORY_RETENTION_S`); its owner, `controller.ingest.series.RateSeries`, seeds it
from the stored per-minute rollups and samples the fleet's live rates into it.

The controller samples every model at once (`sample(now, rates)`), so the models
share one time axis: the sample times are kept once, and each model's rates are a
row of a fleet-wide matrix (NaN where the model had no sample), stored in blocks of
`ROWS_PER_BLOCK` rows so that a new model never copies the others.

A rate is kept as a float32 (4 bytes a sample): a fleet of 10,000 models keeps 8
days at 5-minute resolution in about 96 MB (float64 took 190, and a (time, rate)
ring per model twice that). A float32 holds a rate to 7 significant digits (a
relative error under 2**-24, 6e-8), far finer than a rate is measured (requests
counted over an agent's 10-s interval: 0.1 rps a request); every reader computes
in float64 on the stored values (`arrays` returns them as float64), so signals are
the float64 figures of the stored rates, within 6e-8 of those of the reported ones. The columns are kept in
order in a buffer a little longer than the retention (`SLACK_FRACTION`), shifted
back when it fills, so that a model's row is a plain slice: the policy tick reads
every model's samples without copying them (`blocks`).

The retention counts columns: a model keeps its samples of the newest
`retention_s / resolution_s` sample times of the fleet.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import numpy as np
import numpy.typing as npt

HISTORY_RETENTION_S = 8 * 24 * 3600.0
ROWS_PER_BLOCK = 64  # models per block of the matrix
SLACK_FRACTION = 1 / 32  # extra columns, so that the buffer shifts once every that many samples
INITIAL_COLUMNS = 64  # the buffer grows by doubling up to the retention's count (plus slack)

FloatArray = npt.NDArray[np.float64]
RateArray = npt.NDArray[np.float32]
RATE_DTYPE = np.float32  # the stored rates (see the module docstring)


class RateHistory:
    """Per-model request-rate samples at a fixed resolution, in memory and bounded."""

    def __init__(self, resolution_s: float, retention_s: float = HISTORY_RETENTION_S) -> None:
        self.resolution_s = resolution_s
        self._max = max(10, int(retention_s / resolution_s))
        self._full = self._max + max(1, int(self._max * SLACK_FRACTION))  # buffer columns
        self._ts = np.empty(min(INITIAL_COLUMNS, self._full))
        self._lo = self._hi = 0  # live columns: [_lo, _hi), oldest first
        self._blocks: list[RateArray] = []
        self._row: dict[str, int] = {}  # model -> its row
        self._newest: dict[str, float] = {}  # model -> time of its newest sample
        self._last_sample = 0.0
        # Writes and `arrays` hold it: the forecast worker reads rows from its own thread.
        self._lock = threading.Lock()

    @property
    def retention_s(self) -> float:
        """How far back the kept sample times reach: the retention, in whole steps."""
        return self._max * self.resolution_s

    # -- writing ------------------------------------------------------------------

    def due(self, now: float) -> bool:
        return now - self._last_sample >= self.resolution_s * 0.999

    def sample(self, now: float, rates: Mapping[str, float]) -> None:
        """One sample per model of `rates` at `now`; a model's sample under half a step
        after its previous one is skipped, and so is one older than the newest column."""
        with self._lock:
            self._sample(now, rates)

    def _sample(self, now: float, rates: Mapping[str, float]) -> None:
        self._last_sample = now
        half = self.resolution_s * 0.5
        taken = {m: r for m, r in rates.items()
                 if (t := self._newest.get(m)) is None or now - t >= half}
        if not taken or (self._hi > self._lo and now < self._ts[self._hi - 1]):
            return
        if self._hi == self._lo or now > self._ts[self._hi - 1]:
            self._append_columns(np.array([now]))
        col = self._hi - 1
        for model, rps in taken.items():
            r = self._row_of(model)
            self._blocks[r // ROWS_PER_BLOCK][r % ROWS_PER_BLOCK, col] = rps
            self._newest[model] = now

    def extend(self, model: str, ts: npt.ArrayLike, rps: npt.ArrayLike) -> None:
        """Append `model`'s samples (times ascending, after its newest) at once, as seeding
        from stored history does: the bulk form of one sample per step."""
        self.extend_many({model: (ts, rps)})

    def extend_many(self, samples: Mapping[str, tuple[npt.ArrayLike, npt.ArrayLike]]) -> None:
        """`extend` of several models, with the time axis merged once."""
        with self._lock:
            self._extend_many(samples)

    def _extend_many(self, samples: Mapping[str, tuple[npt.ArrayLike, npt.ArrayLike]]) -> None:
        found: dict[str, tuple[FloatArray, FloatArray]] = {}
        for model, (ts, rps) in samples.items():
            times = np.asarray(ts, dtype=np.float64).ravel()
            rates = np.asarray(rps, dtype=np.float64).ravel()
            if times.shape != rates.shape:
                raise ValueError(f"{model}: {times.size} sample times but {rates.size} rates")
            if times.size:
                found[model] = (times, rates)
        if not found:
            return
        live = self._ts[self._lo:self._hi]
        new = np.unique(np.concatenate([t for t, _ in found.values()]))
        if live.size:
            new = new[~np.isin(new, live)]
        if new.size:
            if not live.size or new[0] > live[-1]:
                self._append_columns(new)
            else:
                self._merge_columns(new)
        live = self._ts[self._lo:self._hi]
        for model, (times, rates) in found.items():
            keep = times >= live[0]
            times, rates = times[keep], rates[keep]
            r = self._row_of(model)
            self._blocks[r // ROWS_PER_BLOCK][r % ROWS_PER_BLOCK,
                                             self._lo + np.searchsorted(live, times)] = rates
            if times.size:
                self._newest[model] = max(self._newest.get(model, -np.inf), float(times[-1]))

    def _row_of(self, model: str) -> int:
        r = self._row.get(model)
        if r is None:
            r = self._row[model] = len(self._row)
            if r // ROWS_PER_BLOCK == len(self._blocks):
                self._blocks.append(np.full((ROWS_PER_BLOCK, self._ts.size), np.nan,
                                                   dtype=RATE_DTYPE))
        return r

    def _append_columns(self, times: FloatArray) -> None:
        """New columns at `times` (ascending, after the newest), empty in every row."""
        times = times[-self._max:]
        live = self._hi - self._lo
        drop = max(0, live + times.size - self._max)  # the oldest columns leave
        self._lo += drop
        live -= drop
        if self._hi + times.size > self._ts.size:
            if live + times.size > self._ts.size:  # grow (doubling, up to the full buffer)
                size = self._ts.size
                while size < live + times.size:
                    size = min(size * 2, self._full)
                self._resize(size)
            else:  # shift the live columns back to the start of the buffer
                self._resize(self._ts.size)
        cols = slice(self._hi, self._hi + times.size)
        self._ts[cols] = times
        for block in self._blocks:
            block[:, cols] = np.nan
        self._hi += times.size

    def _resize(self, size: int) -> None:
        """The live columns moved to the start of a buffer of `size` columns."""
        live = slice(self._lo, self._hi)
        n = self._hi - self._lo
        if size == self._ts.size:
            self._ts[:n] = self._ts[live]
            for block in self._blocks:
                block[:, :n] = block[:, live]
        else:
            ts = np.empty(size)
            ts[:n] = self._ts[live]
            self._ts = ts
            for i, block in enumerate(self._blocks):
                grown = np.full((ROWS_PER_BLOCK, size), np.nan, dtype=RATE_DTYPE)
                grown[:, :n] = block[:, live]
                self._blocks[i] = grown
        self._lo, self._hi = 0, n

    def _merge_columns(self, times: FloatArray) -> None:
        """New columns at `times` (not all after the newest): the axis is rebuilt, keeping
        the newest retention's worth (rare: seeding models with different times)."""
        live = self._ts[self._lo:self._hi]
        axis = np.union1d(live, times)[-self._max:]
        size = self._ts.size
        while size < axis.size:
            size = min(size * 2, self._full)
        kept = live >= axis[0]
        at = np.searchsorted(axis, live[kept])
        old = np.arange(self._lo, self._hi)[kept]
        for i, block in enumerate(self._blocks):
            rebuilt = np.full((ROWS_PER_BLOCK, size), np.nan, dtype=RATE_DTYPE)
            rebuilt[:, at] = block[:, old]
            self._blocks[i] = rebuilt
        self._ts = np.empty(size)
        self._ts[:axis.size] = axis
        self._lo, self._hi = 0, axis.size

    # -- reading ------------------------------------------------------------------

    def models(self) -> list[str]:
        return sorted(self._row)

    def arrays(self, model: str) -> tuple[FloatArray, FloatArray]:
        """(sample times, rates as float64) of `model`, oldest first (copies). Safe from
        another thread (the forecast worker's) while the event loop samples."""
        with self._lock:
            r = self._row.get(model)
            if r is None:
                return np.empty(0), np.empty(0)
            row = self._blocks[r // ROWS_PER_BLOCK][r % ROWS_PER_BLOCK, self._lo:self._hi]
            have = ~np.isnan(row)
            return self._ts[self._lo:self._hi][have], row[have].astype(np.float64)

    def axis(self) -> FloatArray:
        """The sample times of the fleet, oldest first: a read-only view, valid until the
        next write."""
        view = self._ts[self._lo:self._hi]
        view.flags.writeable = False
        return view

    def blocks(self) -> Iterator[tuple[list[str], RateArray]]:
        """(models, their rates on `axis`, one float32 row each, NaN where a model had no
        sample) for the whole fleet, a block at a time: read-only views, valid until the
        next write (compute on them in float64)."""
        names = list(self._row)
        for i, block in enumerate(self._blocks):
            models = names[i * ROWS_PER_BLOCK:(i + 1) * ROWS_PER_BLOCK]
            view = block[:len(models), self._lo:self._hi]
            view.flags.writeable = False
            yield models, view
