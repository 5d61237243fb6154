"""Transfer accounting and budgets: the compression a policy achieves on a model (every layer, windows
included, in the bytes the cache stores), and the knob of a policy (policies.POLICIES' `knob`) that
comes closest to a target compression (settings_for_compression, solve_budget, solve_target).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Callable, Optional

import torch

import cli
from attention import DecodePolicy, DenseDecode
from cache import KVFormat
from kernels import TORCH_KERNELS
from model import ModelArgs
from baselines import QUEST_PAGES
from policies import DENSE, OPTIONAL_SETTINGS, POLICIES, AttentionSettings, fraction_label, policy_factory
from sparq_adaptive import StepCosts


def compression_ratio(policy: DecodePolicy, seq_len: int, head_dim: int) -> float:
    """Transfers of `policy` relative to dense attention at the same length (paper, Appendix G)."""
    return policy.transfer_elements(seq_len, head_dim) / DenseDecode().transfer_elements(seq_len, head_dim)


def model_compression(model, seq_len: int, policies: Optional[list[DecodePolicy]] = None) -> float:
    """KV transfers of a decode step at live length seq_len with `policies` (default: the installed
    ones) relative to dense, over every layer (a window layer counts the min(S, window) it reads)."""
    dense = [DenseDecode()] * model.args.n_layer
    return model.decode_kv_bytes(seq_len, 1, policies) / model.decode_kv_bytes(seq_len, 1, dense)


def _closest(ratio: Callable[[int], float], lo: int, hi: int, target: float) -> int:
    """The integer x in [lo, hi] with ratio(x) closest to target, for ratio non-decreasing in x."""
    a, b = lo, hi
    while a < b:  # smallest x with ratio(x) >= target (or hi)
        mid = (a + b) // 2
        if ratio(mid) >= target:
            b = mid
        else:
            a = mid + 1
    best = a
    if a > lo and abs(ratio(a - 1) - target) <= abs(ratio(a) - target):
        best = a - 1
    return best


def visible_lengths(args: ModelArgs, seq_len: int) -> list[int]:
    """The positions each layer of `args` reads at live length seq_len: min(S, window) on a window layer."""
    return [seq_len if args.window(layer) is None else min(seq_len, args.window(layer)) for layer in range(args.n_layer)]


def layer_transfers(make_policy: Callable[[int], DecodePolicy], args: ModelArgs, seq_len: int) -> int:
    """KV elements one decode step moves per KV head, summed over the layers of `args`, with layer i
    running make_policy(i) over the positions it sees (min(S, window) on a window layer): the
    element count behind Transformer.decode_kv_bytes, from the args alone."""
    return sum(make_policy(layer).transfer_elements(visible, args.head_dim)
               for layer, visible in enumerate(visible_lengths(args, seq_len)))


@dataclass(frozen=True)
class Storage:
    """How the cache stores K, V and K^T (--kv-dtype / --kt-dtype) for activations in `activation`:
    what a budget counts, since a quantized K^T makes step 1's rows cheaper than K and V's."""

    fmt: KVFormat = KVFormat()
    activation: torch.dtype = torch.float32


FLOAT_CACHE = Storage()  # any float cache: bytes per element cancel, the ratio is the paper's in elements


def layer_bytes(make_policy: Callable[[int], DecodePolicy], args: ModelArgs, seq_len: int, storage: Storage) -> float:
    """layer_transfers in bytes as `storage` holds them (scales included): DecodePolicy.transfer_bytes
    summed over the layers, each over the positions it sees."""
    return sum(make_policy(layer).transfer_bytes(visible, args.head_dim, storage.fmt, storage.activation)
               for layer, visible in enumerate(visible_lengths(args, seq_len)))


def settings_for_compression(settings: AttentionSettings, target: float, seq_len: int, args: ModelArgs,
                             storage: Storage = FLOAT_CACHE) -> tuple[AttentionSettings, float]:
    """The settings of `settings.policy` whose model-wide transfers at seq_len are closest to target x
    dense, and the compression they achieve. Its registry knob is solved (SparQ: r at fixed k, or k at
    fixed r; the baselines: their budget k); target 1, or a policy without a knob, is dense.

    The ratio is over every layer as policy_factory installs them: a sliding-window layer reads only
    min(S, window) positions, and stays dense where the policy would not save there, so on a model
    with window layers (Gemma 3) the global layers' budget is not the model's compression. It counts
    bytes as `storage` holds them, against dense on the same cache: on a float cache, the paper's
    element ratio; with an int4 K^T, step 1's rows at half a byte (and its scales), so r grows."""
    entry = POLICIES[settings.policy]
    if entry.knob is None or target >= 1:
        return AttentionSettings("dense"), 1.0
    if entry.knob == "compression":
        best = replace(settings, compression=Fraction(target).limit_denominator(1 << 16))
        return best, _compression_ratio(best, seq_len, args, storage)
    if "page_size" in entry.flags:  # pages too small to reach the target: larger ones cost less metadata
        settings = replace(settings, page_size=_pages_for(settings, target, seq_len, args, storage))
    ratio, lo, hi = _knob_ratio(settings, seq_len, args, storage)
    if entry.knob == "sparq_r" and ratio(hi) < target:  # every component read, budget left: more positions
        return _positions_for(replace(settings, sparq_r=hi), target, seq_len, args, storage)
    while entry.knob == "sparq_r" and ratio(lo) > target and settings.sparq_k > MIN_SPARQ_K:
        # k alone reads more than the target (short prompts, low targets): half the positions, then r again
        settings = replace(settings, sparq_k=max(MIN_SPARQ_K, settings.sparq_k // 2))
        ratio, lo, hi = _knob_ratio(settings, seq_len, args, storage)
    best = replace(settings, **{entry.knob: _closest(ratio, lo, hi, target)})
    return best, ratio(getattr(best, entry.knob))


MIN_SPARQ_K = 8  # the fewest positions SparQ's budget goes down to before a target is out of its reach


def _positions_for(settings: AttentionSettings, target: float, seq_len: int, args: ModelArgs,
                   storage: Storage) -> tuple[AttentionSettings, float]:
    """SparQ at every component (r = d) with the k closest to the target: a budget generous enough to read all
    of a cheap K^T (an int4 one at 1/4) spends the rest on positions, as sparq-fixed-r solves k."""
    def ratio(k: int) -> float:
        return _compression_ratio(replace(settings, sparq_k=k), seq_len, args, storage)

    k = _closest(ratio, settings.sparq_k, max(seq_len - 1, settings.sparq_k), target)
    return replace(settings, sparq_k=k), ratio(k)


def _pages_for(settings: AttentionSettings, target: float, seq_len: int, args: ModelArgs, storage: Storage) -> int:
    """The page size a page selector (Quest, the hybrid) needs for `target`: its own where that reaches it,
    else the smallest of QUEST_PAGES from it on whose one-page budget does (the largest if none)."""
    sizes = [p for p in QUEST_PAGES if p >= settings.page_size] or [settings.page_size]
    for page in sizes:
        if _compression_ratio(replace(settings, page_size=page, kv_budget=page), seq_len, args, storage) <= target:
            return page
    return sizes[-1]


def _knob_ratio(settings: AttentionSettings, seq_len: int, args: ModelArgs,
                storage: Storage) -> tuple[Callable[[int], float], int, int]:
    """(ratio(x): model-wide transfers / dense with the policy's knob at x, the knob's lowest and highest value)."""
    entry = POLICIES[settings.policy]

    def ratio(x: int) -> float:
        return _compression_ratio(replace(settings, **{entry.knob: x}), seq_len, args, storage)

    lo = entry.knob_min(settings)
    hi = args.head_dim if entry.knob == "sparq_r" else max(seq_len - 1, lo)
    return ratio, lo, hi


def _compression_ratio(settings: AttentionSettings, seq_len: int, args: ModelArgs, storage: Storage) -> float:
    """Model-wide transfers / dense of settings at seq_len, in bytes as `storage` holds them."""
    dense = layer_bytes(lambda layer: DenseDecode(), args, seq_len, storage)
    return layer_bytes(policy_factory(settings, args), args, seq_len, storage) / dense


def reachable_compression(settings: AttentionSettings, seq_len: int, args: ModelArgs,
                          storage: Storage = FLOAT_CACHE) -> tuple[float, float]:
    """The lowest and highest compression settings.policy reaches at seq_len over its knob's range (a policy
    taking the target itself: from the smallest target, r = k = 1, to 1)."""
    if POLICIES[settings.policy].knob == "compression":
        return _compression_ratio(replace(settings, compression=Fraction(1, 1 << 16)), seq_len, args, storage), 1.0
    ratio, lo, hi = _knob_ratio(settings, seq_len, args, storage)
    return ratio(lo), ratio(hi)




@dataclass(frozen=True)
class Budget:
    """A method's settings for one target compression at sequence length seq_len."""

    method: str
    target: Fraction
    seq_len: int
    settings: AttentionSettings
    achieved: float = 1.0  # transfers / dense at seq_len
    split: Optional[tuple[int, int]] = None  # sparq-adaptive: its (r, k) on a layer that sees all seq_len positions

    @property
    def r(self) -> Optional[int]:
        """SparQ's fixed r (None: a policy without one; adaptive SparQ's varies, `split` has it at seq_len)."""
        return self.settings.sparq_r

    @property
    def k_top(self) -> Optional[int]:
        """The positions the method attends (its budget, SparQ's k, or adaptive SparQ's at seq_len)."""
        if self.split is not None:
            return self.split[1]
        uses_budget = self.method != "dense" and "kv_budget" in POLICIES[self.method].flags
        return self.settings.budget if uses_budget else self.settings.sparq_k

    def describe(self) -> str:
        if self.method == "dense":
            return "dense"
        if POLICIES[self.method].knob == "compression":
            cap = self.settings.adaptive_k_cap
            at = "" if self.split is None else f": r={self.split[0]}, k={self.split[1]} on a full-length layer"
            capped = "" if cap is None else f", k capped at {cap} plus what rounding r down leaves"
            capped += ", the KV heads pooled" if self.settings.adaptive_heads == "pooled" else ""
            setting = f"r and k per layer and step (sparq_adaptive.adaptive_split{capped}){at}"
        else:
            setting = f"r={self.r}, k={self.k_top}" if self.r is not None else f"k={self.k_top}"
            if "page_size" in POLICIES[self.method].flags:
                setting += f", pages of {self.settings.page_size}"
        below = (f"; all it reads, below the target of {float(self.target):.3f}"
                 if self.achieved < float(self.target) * (1 - REACH_TOLERANCE) else "")
        return f"{self.method} {setting} ({self.achieved:.3f} of dense at S={self.seq_len}{below})"


def solve_budget(method: str, target: Fraction, seq_len: int, args: ModelArgs,
                 base: AttentionSettings = AttentionSettings(), storage: Storage = FLOAT_CACHE) -> Budget:
    """Budget for `method` whose transfers at seq_len are closest to target x dense (Appendix G), in
    bytes as `storage` holds them."""
    flags = POLICIES[method].flags  # the base's optional settings (fixed-r SparQ's r, a page size) only where
    unset = {flag: default for flag, default in OPTIONAL_SETTINGS if flag not in flags}  # the policy reads them
    start = replace(base, **{**unset, "policy": method, "kv_budget": None})
    settings, achieved = settings_for_compression(start, float(target), seq_len, args, storage)
    if settings.policy == "dense":
        return Budget("dense", DENSE, seq_len, settings)
    split = None
    if POLICIES[method].knob == "compression":  # adaptive SparQ: its split at seq_len, in the cache's bytes
        policy = POLICIES[method].build(settings, args, TORCH_KERNELS, 0)
        split = policy.split(seq_len, args.head_dim, StepCosts.of(storage.fmt, storage.activation, args.head_dim))
    return Budget(method, target, seq_len, settings, achieved, split)


REACH_TOLERANCE = 0.02  # a target this far (relative) below what the knob's range reaches is refused


def solve_target(settings: AttentionSettings, seq_len: int, args: ModelArgs, storage: Storage = FLOAT_CACHE) -> Budget:
    """The budget for settings.compression (generate.py's --compression) at seq_len (a batch's longest
    prompt), in bytes as `storage` holds them: the closest knob (reported as achieved). A target is a ceiling:
    above all the policy reads (a budget SparQ's cheap K^T and positions up to the prompt cannot spend) it takes
    its most, reported as the lower fraction it reads; below its floor it is a one-line error naming the range
    (it would read more than asked), e.g. FlexGen's top-k (which reads all of K) under 1/2, or SparQ on a model
    whose window layers stay dense."""
    budget = solve_budget(settings.policy, settings.compression, seq_len, args, settings, storage)
    if budget.method == "dense":  # a target of 1
        return budget
    lowest, highest = reachable_compression(budget.settings, seq_len, args, storage)
    target = float(settings.compression)
    if target < lowest * (1 - REACH_TOLERANCE):
        raise cli.UserError(f"--compression {fraction_label(settings.compression)} is out of reach of "
                            f"{settings.policy} at {seq_len} tokens: its transfers range from {lowest:.3f} "
                            f"(1/{1 / lowest:.1f}, the lowest target it reaches) to {highest:.3f} of dense")
    return budget
