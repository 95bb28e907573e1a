"""`PTQ`: post-training quantization. A trained float model is quantized without training; each quantized linear's
input range is chosen on a few calibration batches. No Lightning: a model, a function that runs it on a batch, and
the batches.

Weights are exported as `QAT` exports them (symmetric int`bits`, one scale per output channel or per group of
`group_size` inputs, through `IntLinear`); their range is the absmax (`weight_method: minmax`, QAT's) or, per
channel, the clip that minimises the weight's squared quantization error (`mse`). Activations are 7-bit asymmetric
per tensor (QAT's `act_qparams`: codes 0..127, which fbgemm's AVX2 kernel cannot saturate), with the range
[lo, hi] chosen by
    minmax      the smallest and largest value seen: nothing clipped, the coarsest grid;
    percentile  the (100 - p)-th and p-th percentiles: the p-tail outliers are clipped, the grid is finer;
    mse         the candidate range with the smallest summed squared quantization error over every value seen;
    kl          the candidate whose quantized distribution is closest to the observed one (KL(P || Q)), after
                TensorRT's entropy calibration: each quantization level spreads its mass evenly over the histogram
                bins that fall in it, so clipping a tail onto an edge level, or merging too many bins, both cost.
Candidates for mse and kl are [a * min, b * max] for a, b in {1/grid, 2/grid, ..., 1}. Calibration runs the batches
twice: once for every input's min and max, once for a histogram of `bins` bins over that range, so percentile, mse
and kl see every value (at bin resolution) without storing them. The histograms, and the search over candidates,
stay on the device of the activations.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Literal, Optional, Sequence

import torch
from torch import Tensor, nn

from lit_lm.callbacks.compress.core import DEFAULT_EXCLUDE, select
from lit_lm.callbacks.compress.qat import ACT_QMAX, IntLinear, act_qparams, export_act, fake_quant_weight, \
    quantize_weight, weight_scale
from lit_lm.config import ConfigError
from lit_lm.strategies.base import whole_weights

Method = Literal["minmax", "percentile", "mse", "kl"]
METHODS = ("minmax", "percentile", "mse", "kl")
KL_EPS = 1e-4  # Q's probability where P has mass and Q none (else clipping one outlier onto an empty edge is infinite)


# -- choosing a range from (values, counts): raw values with counts 1, or a histogram's bin centres ---------------
def candidate_ranges(lo: float, hi: float, grid: int, device: Optional[torch.device] = None) -> Tensor:
    """(grid², 2) ranges [a * lo, b * hi], a and b in {1/grid, ..., 1}."""
    fractions = torch.arange(1, grid + 1, dtype=torch.float64, device=device) / grid
    a, b = torch.meshgrid(fractions, fractions, indexing="ij")
    return torch.stack([a.reshape(-1) * lo, b.reshape(-1) * hi], dim=1)


def _codes(values: Tensor, ranges: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(codes (K, n), scales (K,), zero points (K,)) of `values` under each candidate range (QAT's 7-bit codes)."""
    scale, zero = (t.double() for t in act_qparams(ranges[:, 0], ranges[:, 1]))
    codes = torch.clamp(torch.round(values[None] / scale[:, None]) + zero[:, None], 0, ACT_QMAX)
    return codes, scale, zero


def quant_errors(values: Tensor, counts: Tensor, ranges: Tensor) -> Tensor:
    """(K,) summed squared error of quantize-dequantize under each candidate range."""
    values, counts = values.double(), counts.double()
    codes, scale, zero = _codes(values, ranges)
    return (((codes - zero[:, None]) * scale[:, None] - values[None]) ** 2 * counts[None]).sum(1)


def kl_divergences(values: Tensor, counts: Tensor, ranges: Tensor) -> Tensor:
    """(K,) KL(P || Q) per candidate range: P the distribution over the points inside the range, each clipped tail's
    mass added to the edge point next to it; Q each quantization level's share of the points inside the range,
    *without* the tails, spread evenly over the level's non-empty points (TensorRT's entropy calibration, on both
    tails): clipping costs where the tails pile onto an edge, merging points into levels costs elsewhere. As
    there, a candidate must hold at least as many points (bins) as there are levels."""
    order = values.argsort()
    v, c = values[order].double(), counts[order].double()
    rows = torch.arange(len(ranges), device=values.device)
    inside = (v[None] >= ranges[:, :1]) & (v[None] <= ranges[:, 1:])  # (K, n)
    first = inside.double().argmax(1)
    last = len(v) - 1 - inside.flip(1).double().argmax(1)
    p = c[None] * inside
    p[rows, first] += (c[None] * (v[None] < ranges[:, :1])).sum(1)
    p[rows, last] += (c[None] * (v[None] > ranges[:, 1:])).sum(1)
    codes = _codes(v, ranges)[0].long()
    kept = c[None] * inside  # the points inside, tails left out
    levels = ACT_QMAX + 1
    mass = p.new_zeros(len(ranges), levels).scatter_add_(1, codes, kept)
    points = p.new_zeros(len(ranges), levels).scatter_add_(1, codes, (kept > 0).double())
    q = torch.where(kept > 0, mass.gather(1, codes) / points.gather(1, codes).clamp(min=1), 0.0)
    filled = p > 0
    p, q = p / p.sum(1, keepdim=True), q / q.sum(1, keepdim=True)
    q = torch.where(filled & (q == 0), KL_EPS, q)  # an edge point that only the clipped tail fills (as MXNet's)
    kl = torch.where(filled, p * (p / q.clamp(min=1e-300)).log(), torch.zeros_like(p)).sum(1)
    # a range narrower than `levels` points quantizes each point exactly, so the histogram cannot see its rounding
    return torch.where(inside.sum(1) >= levels, kl, torch.full_like(kl, math.inf))


def percentile_range(values: Tensor, counts: Tensor, percentile: float) -> tuple[float, float]:
    """The smallest hi with at least `percentile`% of the mass at or below it, and the largest lo with at least
    `percentile`% at or above it."""
    order = values.argsort()
    values, cum = values[order], counts[order].double().cumsum(0)
    need = percentile / 100 * cum[-1]
    hi = values[torch.searchsorted(cum, need - 1e-9 * cum[-1])]
    above = cum[-1] - torch.cat([cum.new_zeros(1), cum[:-1]])  # mass at or above each value
    lo = values[(above >= need - 1e-9 * cum[-1]).nonzero().max()]
    return float(lo), float(hi)


def choose_range(values: Tensor, counts: Tensor, method: Method, percentile: float = 99.99,
                 grid: int = 32) -> tuple[float, float]:
    """The activation range [lo, hi] that `method` picks for the distribution (values, counts)."""
    lo, hi = float(values.min()), float(values.max())
    if method == "minmax":
        return lo, hi
    if method == "percentile":
        return percentile_range(values, counts, percentile)
    ranges = candidate_ranges(lo, hi, grid, values.device)
    score = quant_errors(values, counts, ranges) if method == "mse" else kl_divergences(values, counts, ranges)
    best = ranges[int(score.argmin())]  # (first of equal scores: the grid runs from the tightest range)
    return float(best[0]), float(best[1])


def mse_weight_scale(w: Tensor, bits: int, group_size: Optional[int] = None, grid: int = 32) -> Tensor:
    """Per channel (or group), the scale r * absmax / qmax, r in {1/grid, ..., 1}, with the least squared error."""
    absmax = weight_scale(w, bits, group_size)
    rows = w.detach().float().reshape(*absmax.shape, -1)
    best, best_err = absmax, torch.full_like(absmax, math.inf)
    for r in range(1, grid + 1):
        scale = absmax * r / grid
        err = (fake_quant_weight(rows, scale, bits) - rows).pow(2).sum(-1)
        better = err < best_err
        best, best_err = torch.where(better, scale, best), torch.where(better, err, best_err)
    return best


# -- calibration -----------------------------------------------------------------------------------------------
class PTQ:
    """Calibrate and quantize a float model (see the module docstring).

    Args:
        bits: weight bits (8 or 4). group_size: inputs per weight scale (None: one per output channel).
        method: activation range: minmax | percentile | mse | kl. weight_method: minmax | mse.
        percentile: for `percentile`. bins: histogram bins per input. grid: candidates per side for mse and kl.
        include, exclude: module-name globs of the linears to quantize; embeddings and head excluded.
    """

    def __init__(self, bits: int = 8, group_size: Optional[int] = None, method: Method = "minmax",
                 weight_method: Literal["minmax", "mse"] = "minmax", percentile: float = 99.99, bins: int = 4096,
                 grid: int = 32, include: Optional[list[str]] = None, exclude: Sequence[str] = DEFAULT_EXCLUDE) -> None:
        if bits not in (3, 4, 8):
            raise ConfigError(f"PTQ.bits must be 3, 4 or 8 (ternary and binary weights need QAT), got {bits}")
        if method not in METHODS or weight_method not in ("minmax", "mse"):
            raise ConfigError(f"PTQ.method must be one of {METHODS} and PTQ.weight_method minmax or mse, got "
                              f"{method!r}, {weight_method!r}")
        if not 50.0 < percentile <= 100.0:
            raise ConfigError(f"PTQ.percentile must be in (50, 100], got {percentile}")
        self.bits, self.group_size, self.method, self.weight_method = bits, group_size, method, weight_method
        self.percentile, self.bins, self.grid = percentile, bins, grid
        self.include, self.exclude = include, tuple(exclude)
        self.ranges: dict[str, tuple[float, float]] = {}  # module name -> the chosen activation range

    def linears(self, model: nn.Module) -> list[str]:
        return [ws.name[: -len(".weight")] for ws in select(whole_weights(model), self.include, self.exclude, "PTQ")]

    @torch.no_grad()
    def calibrate(self, model: nn.Module, run: Callable[[Any], Any], batches: Iterable[Any]) -> dict[str, tuple]:
        """Choose every selected linear's input range from `run(batch)` over `batches` (names relative to
        `model`); returns and keeps them in `ranges`."""
        batches = list(batches)
        names = self.linears(model)
        seen: dict[str, Tensor] = {}  # name -> [-min, max] so far, on the activations' device

        def extremes(name: str, x: Tensor) -> None:
            batch = torch.stack([-x.detach().min(), x.detach().max()]).double()
            seen[name] = torch.maximum(seen[name], batch) if name in seen else batch

        self._observe(model, names, run, batches, extremes)
        # one host read a layer (a layer that saw no input keeps the empty range [inf, -inf])
        low = {n: -float(seen[n][0]) if n in seen else math.inf for n in names}
        high = {n: float(seen[n][1]) if n in seen else -math.inf for n in names}
        if self.method == "minmax":
            self.ranges = {n: (low[n], high[n]) for n in names}
            return self.ranges
        hist: dict[str, Tensor] = {}  # name -> counts per bin, on the activations' device

        def histogram(name: str, x: Tensor) -> None:
            counts = torch.histc(x.detach().double(), self.bins, low[name], high[name])
            hist[name] = hist[name] + counts if name in hist else counts

        self._observe(model, names, run, batches, histogram)
        for n in names:
            width = (high[n] - low[n]) / self.bins
            if not width > 0:
                self.ranges[n] = (low[n], high[n])
                continue
            centres = low[n] + width * (torch.arange(self.bins, dtype=torch.float64, device=hist[n].device) + 0.5)
            self.ranges[n] = choose_range(centres, hist[n], self.method, self.percentile, self.grid)
        return self.ranges

    @staticmethod
    def _observe(model: nn.Module, names: list[str], run: Callable[[Any], Any], batches: list[Any],
                 see: Callable[[str, Tensor], None]) -> None:
        def hook(name: str) -> Callable[..., None]:
            return lambda module, args: see(name, args[0])

        handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
        try:
            for batch in batches:
                run(batch)
        finally:
            for h in handles:
                h.remove()

    def weight_scale(self, w: Tensor) -> Tensor:
        if self.weight_method == "mse":
            return mse_weight_scale(w, self.bits, self.group_size, self.grid)
        return weight_scale(w, self.bits, self.group_size)

    @torch.no_grad()
    def convert(self, model: nn.Module) -> nn.Module:
        """Replace every calibrated linear of `model` by an `IntLinear` (QAT's export), in place."""
        if not self.ranges:
            raise RuntimeError("PTQ.convert before calibrate: no activation ranges")
        for name, (lo, hi) in self.ranges.items():
            w = model.get_submodule(name).weight
            scale = self.weight_scale(w)
            model.set_submodule(name, IntLinear(quantize_weight(w, scale, self.bits), scale, self.bits,
                                                export_act(lo, hi)))
        return model
