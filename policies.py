"""The registry of decode attention policies, their command-line flags and how each is built.

- AttentionSettings: a run's attention choices as values (from the flags, or eval's budgets).
- POLICIES: name -> Policy, the one registry: which function builds a layer's policy from the
  settings, which optional flags it reads and which knob a target compression solves for.
  generate.py, serve.py, bench and evals take names, flags and builders from here; budgets.py solves
  their knobs. Adding a policy is one class (sparq.py, sparq_adaptive.py, baselines.py) and one entry.
- policy_factory / install_policy: every layer its own instance (H2O keeps per-layer state), the
  window layers dense where the policy would not save there.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Optional

import cli
from attention import DecodePolicy, DenseDecode
from baselines import (CHANNELS_FILE, QUEST_PAGE, QUEST_PAGES, DoubleSparseDecode, H2ODecode, LocalDecode,
                       OracleDecode, QuestDecode, RocketKVHybridDecode, TopKDecode, default_channels_file,
                       load_channel_ranking)
from kernels import TORCH_KERNELS, Kernels
from model import ModelArgs
from sparq import SparQConfig, SparQDecode
from sparq_adaptive import SparQAdaptiveDecode

DEFAULT_SPARQ_K = 128
ADAPTIVE_DEFAULT = Fraction(1, 8)  # sparq-adaptive's compression when neither --sparq-r nor --compression is given
ADAPTIVE_HEADS = ("each", "pooled")  # --adaptive-heads: sparq_adaptive.SparQAdaptiveDecode's per_head, or not
DENSE = Fraction(1)  # the target compression that is dense attention, every method's baseline


@dataclass(frozen=True)
class AttentionSettings:
    """The decode-attention choices of a run, as values: flags (attention_settings) or eval's budgets."""

    policy: str = "dense"
    sparq_r: Optional[int] = None  # SparQ: query components for the approximate scores
    sparq_k: int = DEFAULT_SPARQ_K  # SparQ: positions attended exactly
    sparq_local: Optional[int] = None  # SparQ, H2O, the oracle: recent positions always kept (None: k / 4)
    sparq_mean_v: str = "auto"  # "on", "off", or "auto": on for MHA, off for GQA (the paper's choice)
    kv_budget: Optional[int] = None  # baselines: positions attended (None: sparq_k)
    compression: Optional[Fraction] = None  # a target (--compression): solve_target sets the policy's knob
    page_size: int = QUEST_PAGE  # Quest and the RocketKV hybrid: positions per page
    hybrid_r: Optional[int] = None  # the RocketKV hybrid: components of q its page bounds use (None: d / 4)
    channels: Optional[Path] = None  # DoubleSparse: its calibration file (default_channels_file)
    adaptive_k_cap: Optional[int] = None  # sparq-adaptive: a cap on k (sparq_adaptive.adaptive_split; None: the budget's share)
    adaptive_heads: str = "each"  # sparq-adaptive: "each" KV head selects its own, or a row's heads "pooled"

    @property
    def budget(self) -> int:
        return self.sparq_k if self.kv_budget is None else self.kv_budget

    def mean_v(self, args: ModelArgs) -> bool:
        return {"on": True, "off": False, "auto": args.n_kv_head == args.n_head}[self.sparq_mean_v]

    def sparq_config(self, args: ModelArgs, r: Optional[int] = None, k: Optional[int] = None) -> SparQConfig:
        """SparQConfig(r, k) from these settings (validated: ValueError in one line)."""
        config = SparQConfig(r=self.sparq_r if r is None else r, k_top=self.sparq_k if k is None else k,
                             local=self.sparq_local, mean_v=self.mean_v(args))
        config.validate(args.head_dim)
        return config


# ---------------------------------------------------------------------------------------------
# Builders: one layer's policy from the settings (ValueError in one line for settings it refuses)
# ---------------------------------------------------------------------------------------------


def build_dense(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> DenseDecode:
    return DenseDecode(kernels, args.attn_softcap)


def build_sparq(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> SparQDecode:
    """SparQ at the run's (r, k): --sparq-r, or r solved for a --compression by budgets.py."""
    if s.sparq_r is None:
        raise ValueError("--attention sparq needs --sparq-r")
    return SparQDecode(s.sparq_config(args), kernels, args.attn_softcap)


def build_sparq_adaptive(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> SparQAdaptiveDecode:
    compression = ADAPTIVE_DEFAULT if s.compression is None else s.compression
    return SparQAdaptiveDecode(float(compression), s.sparq_k, s.mean_v(args), kernels, args.attn_softcap,
                               s.adaptive_k_cap, per_head=s.adaptive_heads == "each")


def build_topk(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> TopKDecode:
    return TopKDecode(s.budget, args.attn_softcap)


def build_oracle(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> OracleDecode:
    return OracleDecode(s.sparq_config(args, r=args.head_dim, k=s.budget), args.attn_softcap)


def build_h2o(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> H2ODecode:
    return H2ODecode(s.budget, s.sparq_local, cap=args.attn_softcap)


def build_local(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> LocalDecode:
    return LocalDecode(s.budget, cap=args.attn_softcap)


def build_quest(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> QuestDecode:
    return QuestDecode(s.budget, s.page_size, cap=args.attn_softcap)


def build_rocketkv(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> RocketKVHybridDecode:
    r = max(1, args.head_dim // 4) if s.hybrid_r is None else s.hybrid_r
    if not 1 <= r <= args.head_dim:
        raise ValueError(f"--hybrid-r must be in [1, {args.head_dim}] (the head dim), got {r}")
    return RocketKVHybridDecode(s.budget, r, s.page_size, cap=args.attn_softcap)


def build_doublesparse(s: AttentionSettings, args: ModelArgs, kernels: Kernels, layer: int) -> DoubleSparseDecode:
    if s.sparq_r is None:
        raise ValueError("--attention doublesparse needs --sparq-r (or --compression)")
    if s.channels is None or not Path(s.channels).exists():
        where = f" ({s.channels} does not exist)" if s.channels is not None else ""
        raise ValueError(f"--attention doublesparse needs its calibrated channels{where}: make them with "
                         f"`python -m scripts.calibrate_doublesparse --checkpoint CHECKPOINT`")
    ranking = load_channel_ranking(Path(s.channels))
    expected = (args.n_layer, args.kv_head_total or args.n_kv_head, args.head_dim)  # the whole model's
    if tuple(ranking.shape) != expected:
        raise ValueError(f"{s.channels} calibrates a model of (layers, KV heads, head dim) {tuple(ranking.shape)}, "
                         f"not this one's {expected}")
    config = s.sparq_config(args)
    heads = slice(args.kv_head_start, args.kv_head_start + args.n_kv_head)  # a tensor-parallel rank's own
    return DoubleSparseDecode(config, ranking[layer, heads, :config.r].contiguous(), kernels, args.attn_softcap)



def one_position(s: AttentionSettings) -> int:
    return 1


def one_page(s: AttentionSettings) -> int:
    """Quest's and the hybrid's smallest budget: one page."""
    return s.page_size


def past_the_sinks(s: AttentionSettings) -> int:
    """LM-Infinite's smallest budget: one position more than its sink tokens."""
    return LocalDecode.SINKS + 1


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------


# The settings only some policies read (Policy.flags), each with its value when not given
OPTIONAL_SETTINGS = (("sparq_r", None), ("kv_budget", None), ("page_size", QUEST_PAGE), ("hybrid_r", None),
                     ("adaptive_k_cap", None), ("adaptive_heads", "each"))


@dataclass(frozen=True)
class Policy:
    """A registry entry: how to build one layer's policy from settings, and which setting a target
    compression solves for (budgets.py)."""

    build: Callable[[AttentionSettings, ModelArgs, Kernels, int], DecodePolicy]  # (settings, args, kernels, layer)
    help: str
    flags: tuple[str, ...] = ()  # the OPTIONAL_SETTINGS it reads: others given are an error
    knob: Optional[str] = None  # the setting a target compression solves for (sparq_r, sparq_k, kv_budget), or
    # "compression": the policy takes the target itself
    knob_min: Callable[[AttentionSettings], int] = one_position  # the knob's smallest value
    reads_buckets: bool = False  # honours bucketed reads (CacheView.live_length): CUDA graphs per bucket
    reads_kt: bool = False  # its step 1 scans rows of the cache's K^T copy (assemble.kt_storage_for decides its storage)


POLICIES: dict[str, Policy] = {
    "dense": Policy(build_dense, "exact attention over the live prefix", reads_buckets=True),
    "sparq": Policy(build_sparq, "SparQ (--sparq-r/-k/-local/-mean-v)", ("sparq_r",), knob="sparq_r",
                    reads_buckets=True, reads_kt=True),
    # The same policy, budgeted the other way (the paper's length sweep): r fixed, k set by the compression.
    "sparq-fixed-r": Policy(build_sparq, "SparQ budgeted by k at a fixed --sparq-r", ("sparq_r",), knob="sparq_k",
                            reads_buckets=True, reads_kt=True),
    # Budgeted by the target itself: r and k per layer and step (sparq_adaptive.adaptive_split)
    "sparq-adaptive": Policy(build_sparq_adaptive, "SparQ with r and k per layer and step from --compression "
                             f"(default 1/{ADAPTIVE_DEFAULT.denominator}; --adaptive-k-cap, --adaptive-heads)",
                             ("adaptive_k_cap", "adaptive_heads"), knob="compression", reads_kt=True),
    "topk": Policy(build_topk, "FlexGen top-k: exact scores, top-k values", ("kv_budget",), knob="kv_budget"),
    "oracle": Policy(build_oracle, "exact top-k at no transfer cost (upper bound)", ("kv_budget",), knob="kv_budget"),
    "h2o": Policy(build_h2o, "H2O: evicting heavy hitters + recent window", ("kv_budget",), knob="kv_budget"),
    "quest": Policy(build_quest, "Quest: page min/max bounds, the top pages (--page-size) read in full",
                    ("kv_budget", "page_size"), knob="kv_budget", knob_min=one_page),
    "rocketkv-hybrid": Policy(build_rocketkv, "RocketKV's hybrid: Quest's page bounds on the top --hybrid-r "
                              "components of q (default d/4), the top pages read in full",
                              ("kv_budget", "hybrid_r", "page_size"), knob="kv_budget", knob_min=one_page),
    "doublesparse": Policy(build_doublesparse, "DoubleSparse: SparQ with r channels per head fixed offline "
                           "(scripts/calibrate_doublesparse.py)", ("sparq_r",), knob="sparq_r", reads_kt=True),
    "local": Policy(build_local, "LM-Infinite: 16 sinks + recent window", ("kv_budget",), knob="kv_budget",
                    knob_min=past_the_sinks),
}


def policy_factory(settings: AttentionSettings, args: ModelArgs,
                   kernels: Kernels = TORCH_KERNELS) -> Callable[[int], DecodePolicy]:
    """make_policy(layer) for Transformer.set_decode_attention: a fresh instance per layer (H2O keeps
    per-layer state). Checks the settings once: ValueError in one line.

    Sliding-window layers read min(S, window) positions: the policy replaces dense attention there
    only when it moves fewer elements than dense over a full window; elsewhere they stay dense.
    Global layers always get the policy."""
    if settings.policy not in POLICIES:
        raise ValueError(f"unknown attention policy {settings.policy!r} (choose from {', '.join(POLICIES)})")
    entry = POLICIES[settings.policy]
    for flag, unset in OPTIONAL_SETTINGS:
        if getattr(settings, flag) != unset and flag not in entry.flags:
            users = "/".join(name for name, e in POLICIES.items() if flag in e.flags)
            raise ValueError(f"--{flag.replace('_', '-')} applies to --attention {users}, not {settings.policy}")
    policy = entry.build(settings, args, kernels, 0)  # validate now, not in the middle of a run
    W = args.sliding_window
    on_windows = W is not None and (
        policy.transfer_elements(W, args.head_dim) < DenseDecode().transfer_elements(W, args.head_dim))

    def make(layer: int) -> DecodePolicy:
        if args.layer_kind(layer) == "window" and not on_windows:
            return DenseDecode(kernels, args.attn_softcap)
        return entry.build(settings, args, kernels, layer)

    return make


def describe_layers(model) -> str:
    """Which policy each kind of layer runs, for the startup line: e.g. 'sparq on 3 global layers,
    dense on 15 window layers (window 512)'."""
    groups: dict[tuple[str, str], int] = {}
    for i, layer in enumerate(model.layers):
        key = (layer.attention.decode_attention.name, model.args.layer_kind(i))
        groups[key] = groups.get(key, 0) + 1
    parts = [f"{name} on {n} {kind} layer{'s' if n > 1 else ''}" for (name, kind), n in groups.items()]
    window = f" (window {model.args.sliding_window})" if model.args.has_window_layers else ""
    return ", ".join(parts) + window



def install_policy(model, settings: AttentionSettings) -> None:
    """Every layer of `model` gets its own instance of the settings' policy, running the model's kernels
    (policy_factory); settings a policy refuses are a one-line UserError."""
    try:
        model.set_decode_attention(policy_factory(settings, model.args, model.kernels))
    except ValueError as e:
        raise cli.UserError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


def add_attention_flags(p: argparse.ArgumentParser) -> None:
    """Decode attention flags, shared by generate.py and python -m bench (attention_settings reads them)."""
    p.add_argument("--attention", choices=list(POLICIES), default=None,
                   help="decode attention policy (default: sparq when --sparq-r is given, else dense): "
                        + "; ".join(f"{name}: {entry.help}" for name, entry in POLICIES.items()))
    p.add_argument("--kv-budget", type=cli.positive_int, default=None,
                   help="positions attended by topk/oracle/h2o/local (default: --sparq-k)")
    p.add_argument("--sparq-r", type=cli.positive_int, default=None, help="query components used for approximate scores")
    p.add_argument("--sparq-k", type=cli.positive_int, default=None,
                   help=f"positions attended exactly (default {DEFAULT_SPARQ_K}); sparq-adaptive: the visible length "
                        "up to which a layer runs dense")
    p.add_argument("--sparq-local", type=cli.non_negative_int, default=None,
                   help="recent positions always kept (default k/4)")
    p.add_argument("--sparq-mean-v", choices=["auto", "on", "off"], default="auto",
                   help="mean-value reallocation (auto: on for MHA, off for GQA)")
    add_selector_flags(p)
    p.add_argument("--compression", type=parse_compression, default=None, metavar="TARGET",
                   help="KV transfers as a fraction of dense (1/8 or 0.125) at the longest prompt: the policy's "
                        "budget solver picks its knob (" + "; ".join(
                            f"{name}: {knob_flag(e.knob)}" for name, e in POLICIES.items() if e.knob) + ")")


def add_selector_flags(p: argparse.ArgumentParser) -> None:
    """The newer selectors' settings (Quest's pages, the hybrid's r, DoubleSparse's calibration, adaptive
    SparQ's cap on k), shared by add_attention_flags and python -m evals."""
    p.add_argument("--page-size", type=int, choices=QUEST_PAGES, default=QUEST_PAGE,
                   help="positions per page of quest and rocketkv-hybrid (default %(default)s)")
    p.add_argument("--hybrid-r", type=cli.positive_int, default=None,
                   help="components of q in rocketkv-hybrid's page bounds (default head dim / 4)")
    p.add_argument("--doublesparse-channels", type=Path, default=None, metavar="FILE",
                   help=f"doublesparse's calibrated channels (default: {CHANNELS_FILE} beside --checkpoint; "
                        "python -m scripts.calibrate_doublesparse makes it)")
    p.add_argument("--adaptive-k-cap", type=cli.positive_int, default=None, metavar="K",
                   help="cap on the positions sparq-adaptive's split gives step 2, before what rounding r down leaves "
                        "is added back (default: none, the budget's share decides)")
    p.add_argument("--adaptive-heads", choices=ADAPTIVE_HEADS, default="each",
                   help="sparq-adaptive's selection: each KV head its own components and positions (default), or "
                        "a layer's KV heads pooling theirs (the earlier default, weaker on common-word extraction)")


def selector_settings(args: argparse.Namespace) -> dict:
    """The AttentionSettings fields of add_selector_flags' flags: DoubleSparse's calibration defaults to the
    file beside the run's --checkpoint, where the command has one."""
    checkpoint = None if getattr(args, "checkpoint", None) is None else Path(args.checkpoint)
    return dict(page_size=args.page_size, hybrid_r=args.hybrid_r, adaptive_k_cap=args.adaptive_k_cap,
                adaptive_heads=args.adaptive_heads,
                channels=args.doublesparse_channels or default_channels_file(checkpoint))


def knob_flag(knob: str) -> str:
    """The command-line flag of a setting: sparq_r -> --sparq-r."""
    return "--" + knob.replace("_", "-")


def attention_settings(args: argparse.Namespace) -> AttentionSettings:
    """AttentionSettings from the flags of add_attention_flags. A --compression target is refused with
    dense attention and beside the flag of the knob it solves (the policy's other settings stay: SparQ's
    --sparq-k is the k at which r is solved, as --sparq-r is for sparq-fixed-r)."""
    target = args.compression
    policy = args.attention or ("sparq" if args.sparq_r is not None or target is not None else "dense")
    if target is not None:
        knob = POLICIES[policy].knob
        if knob is None:
            raise cli.UserError(f"--compression sets the budget of a sparse policy; --attention {policy} has none")
        if knob != "compression" and getattr(args, knob) is not None:
            raise cli.UserError(f"--compression {fraction_label(target)} chooses {knob_flag(knob)} for --attention "
                                f"{policy}: give one or the other")
    return AttentionSettings(policy=policy, sparq_r=args.sparq_r,
                             sparq_k=DEFAULT_SPARQ_K if args.sparq_k is None else args.sparq_k,
                             sparq_local=args.sparq_local, sparq_mean_v=args.sparq_mean_v, kv_budget=args.kv_budget,
                             compression=target, **selector_settings(args))



def fraction_label(c: Fraction) -> str:
    return str(c.numerator) if c.denominator == 1 else f"{c.numerator}/{c.denominator}"


def parse_compression(text: str) -> Fraction:
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise cli.UserError(f"bad --compression value {text!r} (expected e.g. 1/4 or 0.25)") from None
    if not 0 < value <= 1:
        raise cli.UserError(f"--compression values must be in (0, 1], got {text!r}")
    return value.limit_denominator(1 << 16)
