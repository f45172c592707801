"""DeepNorm (Wang et al. 2022, "DeepNet"): every post-LN sublayer computes LN(alpha * x + f(x)) instead of
LN(x + f(x)); at init the FFN, v_proj and out_proj weights (not q, k) are Xavier-normal with gain beta.

  encoder-only  alpha = (2N)^(1/4),  beta = (8N)^(-1/4)      decoder-only  alpha = (2M)^(1/4),  beta = (8M)^(-1/4)
  enc-dec: encoder alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16); decoder alpha = (3M)^(1/4), beta = (12M)^(-1/4)

How the model is changed (module level, the user's own class stays, state_dict keys intact): LN is scale
invariant, LN_eps(alpha x + f) = LN_{eps/alpha^2}(x + f / alpha), exactly, for the forward and for gradients
w.r.t. the same weights. So the module that computes f's last value gets a forward hook ``* 1/alpha`` and a
native norm gets ``eps / alpha^2``; a hand-written norm module whose eps is a constant in its forward gets an
input pre-hook ``* alpha`` instead (alpha (x + f/alpha) = alpha x + f). The model is marked with the attribute
``_normconv_deepnorm`` (saved with it by torch.save) so a second application is refused.

Roles are read from the graph, not from names (``normconv.graph.residual.sublayers``: the sublayers around the
residual adds, the roles of their linears); a pattern the caller gives for v / out that names no attention linear
is refused. This pass chains the sublayers into stacks, counts N and M, and applies the constants.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn as nn

from normconv.clone import clone_sharing_tensors, owned
from normconv.errors import Code, NormconvError
from normconv.graph.capture import Captured
from normconv.graph.detect import NormSite, find_norms
from normconv.graph.residual.sublayers import (BRANCH_NORMED, NOT_IDENTIFIED, Proj, Sublayer, SublayerWhy, matches,
                                               shared, stream_read, sublayer)
from normconv.nn.modules import BranchScale, InputScale
from normconv.report import PassResult, Site, Validation, Why
from normconv.verify import Inputs, compare, run

from .base import Check, Pass, apply, skip

NAME = "deepnorm"
MARKER = "_normconv_deepnorm"  # attribute on the root module: what was applied (survives torch.save(model))
ARCHS = ("encoder", "decoder", "encoder-decoder")
BETA_MODES = ("init", "rescale", "none")


class DeepNormWhy(Why):
    """One member per rule of DeepNorm's decision at a norm site."""

    APPLIED = "post-ln-sublayer"  # LN(x + f(x)) => LN(alpha x + f(x)), beta on the branch's weights
    PRE_LN = "pre-ln"  # x + f(LN(x)): not DeepNorm's sublayer shape
    NOT_SUBLAYER = "not-a-sublayer"  # not after a residual add (an embedding LN, a conv / linear norm)
    EMBEDDING = "embedding-residual"  # a post-LN residual outside the numbered blocks whose f(x) is no sublayer
    BRANCH_NORMED = "branch-normed"  # x + LN(f(x)): the layers normalize their branches, not the stream
    AMBIGUOUS = "residual-ambiguous"  # the add does not tell x from f(x)
    INLINE_NORM = "inline-norm"  # the norm is no module to set eps on or hook
    NOT_IDENTIFIED = "sublayer-not-identified"  # f(x) has no module output to hook, or its roles are not found
    RESHAPED = "branch-reshaped"  # f(x) is added reshaped / transposed after its module: no module output is f(x)
    SHARED_NORM = "norm-shared"  # the norm module is also called where it is no post-LN sublayer
    MODEL_REFUSED = "model-refused"  # this sublayer is fine, the model as a whole is refused (``Analysis.refusal``)


# the sublayer analysis's rule -> this pass's decision
_SUBLAYER = {SublayerWhy.AMBIGUOUS: DeepNormWhy.AMBIGUOUS, SublayerWhy.INLINE_NORM: DeepNormWhy.INLINE_NORM,
             SublayerWhy.BRANCH_NORMED: DeepNormWhy.BRANCH_NORMED, SublayerWhy.SHARED_NORM: DeepNormWhy.SHARED_NORM,
             SublayerWhy.NOT_IDENTIFIED: DeepNormWhy.NOT_IDENTIFIED, SublayerWhy.RESHAPED: DeepNormWhy.RESHAPED}

# ---------------------------------------------------------------------------------------------------------
# constants (DESIGN.md section 4, the paper's table 1)


def constants(arch: str, n: int | None = None, m: int | None = None) -> dict[str, tuple[float, float]]:
    """stack -> (alpha, beta) for an architecture with N encoder and M decoder layers."""
    if arch == "encoder":
        _positive(n, "N")
        return {"encoder": ((2 * n) ** 0.25, (8 * n) ** -0.25)}
    if arch == "decoder":
        _positive(m, "M")
        return {"decoder": ((2 * m) ** 0.25, (8 * m) ** -0.25)}
    if arch == "encoder-decoder":
        _positive(n, "N")
        _positive(m, "M")
        return {"encoder": (0.81 * (n ** 4 * m) ** (1 / 16), 0.87 * (n ** 4 * m) ** (-1 / 16)),
                "decoder": ((3 * m) ** 0.25, (12 * m) ** -0.25)}
    raise NormconvError(f"unknown architecture {arch!r}; choose from: {', '.join(ARCHS)}")


def _positive(v: int | None, name: str) -> None:
    if v is None or v < 1:
        raise NormconvError(f"DeepNorm needs the number of layers {name} >= 1 (got {v})")



# hooks: BranchScale / InputScale live in normconv.nn.modules (picklable, on the weights-only allowlist)
# ---------------------------------------------------------------------------------------------------------
# analysis: the one place decisions are made (plan() shows them, deepnorm() applies them)


@dataclass
class Analysis:
    sublayers: list[Sublayer]
    others: list[tuple[NormSite, str, DeepNormWhy]]  # sites DeepNorm does not touch: why, code
    arch: str | None = None
    layers: dict[str, int] = field(default_factory=dict)  # stack -> N or M
    counted_from: dict[str, str] = field(default_factory=dict)
    consts: dict[str, tuple[float, float]] = field(default_factory=dict)
    refusal: str = ""  # why the whole model is refused ('' = it is not)

    def site_reason(self, s: Sublayer, beta_mode: str) -> str:
        if s.problem:
            return s.problem
        a, b = self.consts.get(s.stack, (float("nan"), float("nan")))
        how = "eps/alpha^2" if _native_eps(s.norm) else "input*alpha"
        text = (f"{s.stack} {s.kind}: LN(alpha*x + f(x)), alpha={a:.4g} ({s.branch_module} * 1/alpha, "
                f"norm {how})")
        if beta_mode != "none":
            touched = [f"{p.role}={p.label()}" for p in s.projs if p.role not in ("q", "k")]
            text += f"; beta={b:.4g} ({beta_mode}) on " + ", ".join(touched)
            if beta_mode == "init" and any(p.role in ("q", "k") for p in s.projs):
                text += "; q,k gain 1: " + ", ".join(p.label() for p in s.projs if p.role in ("q", "k"))
        return text


def analyze(cap: Captured, norms: Sequence[NormSite], arch: str | None = None, n_layers: int | None = None,
            m_layers: int | None = None, beta_mode: str = "init",
            named: dict[str, Sequence[str]] | None = None) -> Analysis:
    """Find the post-LN sublayers, their stacks and layer counts, the roles of their projections.
    ``named`` maps a role (v | out) to module-name patterns (fnmatch) the user gave for it: a linear of an
    attention branch whose module matches takes that role, over what the graph says."""
    post = [s for s in norms if s.kind in ("layernorm", "rmsnorm") and s.placement == "post-norm"]
    others = []
    for s in norms:
        if s in post:
            continue
        # x + f(LN(x))  =>  not DeepNorm's sublayer shape
        if s.placement in ("pre-norm", "final-norm"):
            others.append((s, f"{s.placement} (pre-LN): DeepNorm is defined on post-LN residuals LN(x + f(x))",
                           DeepNormWhy.PRE_LN))
        # not after a residual add (embedding LN, conv/linear norm)  =>  left as is
        else:
            others.append((s, f"not a post-LN residual sublayer ({s.kind}, {s.placement}): left as is",
                           DeepNormWhy.NOT_SUBLAYER))
    outputs = {s.node: s for s in post}
    all_outputs = frozenset(s.node for s in norms)
    named = {r: tuple(p) for r, p in (named or {}).items() if p}
    subs = [sublayer(cap, s, outputs, all_outputs, beta_mode, named) for s in post]
    # a post-LN residual outside the numbered layer blocks whose f(x) is no sublayer (wav2vec2 / HuBERT:
    # LN(x + positional conv(x)) before the first layer) belongs to the embeddings, not to the stack: left as is
    if any(s.block is not None for s in subs):
        embedding = [s for s in subs if s.block is None and s.code == SublayerWhy.NOT_IDENTIFIED]
        others += [(s.norm, f"post-LN residual outside the numbered layer blocks whose f(x) is not a sublayer "
                            f"({s.problem.removeprefix(NOT_IDENTIFIED + ': ')}): the embeddings' own "
                            f"residual, not part of the stack; left as is", DeepNormWhy.EMBEDDING) for s in embedding]
        subs = [s for s in subs if s not in embedding]
    # a norm over x + LN(f(x)) is no post-LN sublayer: it is left, and alone it refuses the model in words
    others += [(s.norm, f"not a post-LN sublayer: {s.problem.removeprefix(BRANCH_NORMED + ': ')}; left as is",
                DeepNormWhy.BRANCH_NORMED) for s in subs if s.code == SublayerWhy.BRANCH_NORMED]
    subs = [s for s in subs if s.code != SublayerWhy.BRANCH_NORMED]
    shared(cap, subs)
    by_node = {s.node: s for s in norms}
    for sub in subs:
        # a final norm over another stack (nn.Transformer's encoder.norm before the memory) reads as that stack
        sub.reads = {stream_read(cap, r, by_node, outputs, all_outputs) for r in sub.reads}
    an = Analysis(subs, others)
    for role, patterns in named.items():
        for pat in patterns:
            # a name the user gave must name something, or it was a typo
            if not any(matches(p.module, (pat,)) for sub in subs for p in sub.roles(role)):
                raise NormconvError(f"--{'value' if role == 'v' else role}-proj {pat!r} matches no linear "
                                    f"module inside a post-LN attention sublayer")
    if not subs:
        pre = sum(1 for s in norms if s.placement in ("pre-norm", "final-norm"))
        branch = [s for s, _, code in others if code == DeepNormWhy.BRANCH_NORMED]
        an.refusal = (f"pre-LN model ({pre} pre-norm/final-norm sites, no post-LN residual LN(x + f(x))): "
                      f"DeepNorm is defined on post-LN transformers" if pre else
                      f"the layers normalize their branches (x + LN(f(x)), as OLMo 2), not the residual stream: "
                      f"{branch[0].target} reads x + LN(f(x)), no post-LN residual LN(x + f(x)); DeepNorm is defined "
                      f"on post-LN transformers" if branch else
                      "no post-LN residual site LN(x + f(x)) found: nothing for DeepNorm to rescale")
        return an
    _stacks(cap, an, arch, n_layers, m_layers)
    return an


def _stacks(cap: Captured, an: Analysis, arch: str | None, n_layers: int | None, m_layers: int | None) -> None:
    """Chains of post-LN sites along the residual stream -> stacks -> N, M -> constants."""
    chains: list[list[Sublayer]] = []
    chain_of: dict[str, int] = {}
    for s in an.sublayers:  # graph order: a site's predecessor is already placed
        if s.follows in chain_of:
            chains[chain_of[s.follows]].append(s)
            chain_of[s.norm.target] = chain_of[s.follows]
        else:
            chain_of[s.norm.target] = len(chains)
            chains.append([s])
    node_to_target = {s.norm.node: s.norm.target for s in an.sublayers}
    if arch is not None and arch not in ARCHS:
        raise NormconvError(f"unknown --arch {arch!r}; choose from: {', '.join(ARCHS)}")
    reads = [{chain_of[node_to_target[n]] for s in c for n in s.reads if n in node_to_target} - {i}
             for i, c in enumerate(chains)]
    if len(chains) > 1 and not any(reads) and not any(s.causal for c in chains for s in c) \
            and arch is None and n_layers is None and m_layers is None and _independent(cap, chains):
        # stacks that read no other stack's output and attend to every position (LiLT's text and layout streams,
        # dual towers): no decoder among them, so each is an encoder with its own N
        _towers(an, chains)
        return
    if len(chains) == 1:
        found = "decoder" if any(s.causal for s in chains[0]) else "encoder"
        if arch == "encoder-decoder":
            an.refusal = (f"--arch encoder-decoder, but the model has one post-LN stack ({len(chains[0])} "
                          f"sublayers): use --arch encoder or decoder")
            return
        arch = arch or found
        names = {0: arch}
    elif len(chains) == 2:
        if reads[1] == {0} and not reads[0] or not any(reads) and _reads_as_memory(cap, chains[0], chains[1]):
            names = {0: "encoder", 1: "decoder"}
        elif reads[0] == {1} and not reads[1] or not any(reads) and _reads_as_memory(cap, chains[1], chains[0]):
            names = {1: "encoder", 0: "decoder"}
        elif reads[0] and reads[1]:
            an.refusal = ("two post-LN stacks reading each other's output (coupled streams, as LiLT's text and "
                          "layout): DeepNorm's constants cover an encoder, a decoder, or a decoder reading an encoder")
            return
        elif any(s.causal for c in chains for s in c):
            an.refusal = ("two post-LN stacks, neither reading the other's output, one with causal attention: "
                          "neither an encoder with a decoder reading it nor two encoder towers")
            return
        else:
            an.refusal = ("two independent post-LN encoder towers: leave out --arch and the layer counts to rewrite "
                          "each as an encoder with its own N")
            return
        if arch not in (None, "encoder-decoder"):
            an.refusal = (f"--arch {arch}, but the model has an encoder and a decoder stack: use "
                          f"--arch encoder-decoder")
            return
        arch = "encoder-decoder"
    else:
        an.refusal = f"{len(chains)} separate post-LN stacks: DeepNorm's constants cover one or two (encoder, decoder)"
        return
    an.arch = arch
    for i, chain in enumerate(chains):
        _count(an, chain, names[i])
    for stack, given in (("encoder", n_layers), ("decoder", m_layers)):
        if given is not None:
            if stack not in an.layers and len(an.layers) == 1:  # --layers for a decoder-only stack
                stack = next(iter(an.layers))
            an.layers[stack] = given
            an.counted_from[stack] = "given"
    an.consts = constants(arch, an.layers.get("encoder"), an.layers.get("decoder"))


def _count(an: Analysis, chain: list[Sublayer], stack: str) -> None:
    """The stack's layers: its numbered blocks, else its FFN sublayers, else its post-LN sublayers."""
    for s in chain:
        s.stack = stack
    blocks = {s.block for s in chain}
    targets = collections.Counter(s.norm.target for s in chain)
    if max(targets.values()) > 1:
        # shared layers (ALBERT): the depth is how many times the layers run, one FFN sublayer per layer run
        ffn = sum(1 for s in chain if s.kind == "ffn")
        an.layers[stack] = ffn or len(chain)
        an.counted_from[stack] = (f"{an.layers[stack]} {'FFN' if ffn else 'post-LN'} sublayer calls of "
                                  f"{len(targets)} shared norm modules")
        return
    split = [b.rpartition(".") for b in blocks if b is not None]  # (list path, ".", index)
    lists = {lst for lst, _, _ in split}
    indices = {lst: {i for owner, _, i in split if owner == lst} for lst in lists}
    if None not in blocks and len(lists) > 1 and not any(lst.rsplit(".", 1)[-1].isdigit() for lst in lists) \
            and len({frozenset(v) for v in indices.values()}) == 1:
        # parallel ModuleLists indexed by layer (XLM / Flaubert: layer_norm1[i], layer_norm2[i]): N = the indices
        an.layers[stack] = len(next(iter(indices.values())))
        an.counted_from[stack] = f"{an.layers[stack]} layers indexed alike in {', '.join(sorted(lists))}"
    elif None not in blocks:
        an.layers[stack] = len(blocks)
        shown = sorted(blocks, key=lambda b: [int(p) if p.isdigit() else 0 for p in b.split(".")])
        an.counted_from[stack] = f"{len(blocks)} numbered blocks ({shown[0]} .. {shown[-1]})"
    else:
        ffn = sum(1 for s in chain if s.kind == "ffn")
        an.layers[stack] = ffn or len(chain)
        an.counted_from[stack] = f"{ffn} FFN sublayers" if ffn else f"{len(chain)} post-LN sublayers"


def _independent(cap: Captured, chains: list[list[Sublayer]]) -> bool:
    """No stack computes from another's norms, by any path (a stream re-joined by an add breaks the residual chain
    into pieces that are not towers: they must not each count as a shallow encoder)."""
    for i, chain in enumerate(chains):
        others = {s.norm.node for j, c in enumerate(chains) if j != i for s in c}
        if not others.isdisjoint(cap.upstream(cap.nodes[s.add] for s in chain if s.add in cap.nodes)):
            return False
    return True


def _reads_as_memory(cap: Captured, enc: list[Sublayer], dec: list[Sublayer]) -> bool:
    """``dec`` reads ``enc`` as a decoder reads its encoder's memory, by dataflow where no cross-attention was
    recognised (LED): dec's branches compute from enc's norms, dec's residual stream does not start from them (a
    stack continuing another's stream would) and enc computes nothing from dec."""
    enc_norms, dec_norms = {s.norm.node for s in enc}, {s.norm.node for s in dec}
    start = cap.upstream([cap.nodes[dec[0].res]]) if dec[0].res in cap.nodes else set()
    return enc_norms.isdisjoint(start) and not enc_norms.isdisjoint(cap.upstream(cap.nodes[s.add] for s in dec)) \
        and dec_norms.isdisjoint(cap.upstream(cap.nodes[s.add] for s in enc))


def _towers(an: Analysis, chains: list[list[Sublayer]]) -> None:
    """Independent encoder stacks: each its own encoder constants, alpha = (2N)^(1/4), beta = (8N)^(-1/4)."""
    an.arch = "encoder"
    for i, chain in enumerate(chains, 1):
        stack = f"encoder {i}"
        _count(an, chain, stack)
        an.counted_from[stack] += f", the stack of {chain[0].norm.target}"
        an.consts[stack] = constants("encoder", an.layers[stack])["encoder"]


def _native_eps(site: NormSite) -> bool:
    return site.module_type in ("LayerNorm", "RMSNorm") and site.source == "module"



def plan(cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
    """What ``normconv deepnorm`` (default --init) would do at each norm site: the analysis deepnorm() applies."""
    return sites_of(analyze(cap, norms, beta_mode="init"), beta_mode="init")


def sites_of(an: Analysis, beta_mode: str) -> list[Site]:
    sites = []
    for s in an.sublayers:
        # LN(x + f(x))  =>  LN(alpha * x + f(x)) (refused as a whole when the model is)
        if s.problem:
            sites.append(skip(NAME, s.norm, s.problem, _SUBLAYER[s.code]))
        elif an.refusal:
            sites.append(skip(NAME, s.norm, an.refusal, DeepNormWhy.MODEL_REFUSED))
        else:
            sites.append(apply(NAME, s.norm, an.site_reason(s, beta_mode), DeepNormWhy.APPLIED))
    sites.extend(skip(NAME, n, why, code) for n, why, code in an.others)
    return sites

# ---------------------------------------------------------------------------------------------------------
# applying


def already_applied(model: nn.Module) -> str | None:
    """Why ``model`` counts as already DeepNorm-rescaled by normconv, or None."""
    mark = getattr(model, MARKER, None)
    if mark is not None:
        return (f"model is already DeepNorm-rescaled by normconv (attribute {MARKER} on the model: arch "
                f"{mark.get('arch')}, alpha {mark.get('alpha')}); applying it twice would compound alpha")
    for path, m in model.named_modules():
        hooks = list(m._forward_hooks.values()) + list(m._forward_pre_hooks.values())
        if any(isinstance(h, (BranchScale, InputScale)) for h in hooks):
            return f"model already carries normconv DeepNorm hooks (on {path or 'the root module'})"
    return None


def _apply(model: nn.Module, an: Analysis, beta_mode: str, alpha: float | None, beta: float | None,
           generator: torch.Generator | None) -> list[dict[str, Any]]:
    modules = dict(model.named_modules())
    done: set[tuple[str, Any]] = set()
    records = []
    for s in an.sublayers:
        if any(r["norm"] == s.norm.target for r in records):
            continue  # a shared norm module (and its branch): rewritten once, acting at every call
        a, b = an.consts[s.stack]
        a = a if alpha is None else alpha
        b = b if beta is None else beta
        norm = modules[s.norm.target]
        # LN_eps(alpha x + f)  =>  LN_{eps/alpha^2}(x + f/alpha)
        modules[s.branch_module].register_forward_hook(BranchScale(1.0 / a))
        if _native_eps(s.norm):
            eps = norm.eps if norm.eps is not None else s.norm.eps
            norm.eps = eps / (a * a)
            how = "eps"
        else:  # hand-written norm module, eps baked into its forward  =>  LN(alpha * (x + f/alpha))
            norm.register_forward_pre_hook(InputScale(a))
            eps, how = None, "input"
        records.append({"norm": s.norm.target, "branch": s.branch_module, "stack": s.stack, "kind": s.kind,
                        "alpha": a, "beta": b, "eps": eps, "how": how,
                        "projections": {p.role: [] for p in s.projs}})
        for p in s.projs:
            records[-1]["projections"][p.role].append(p.label())
        if beta_mode == "none":
            continue
        for p in s.projs:
            key = (p.weight, p.rows)
            if key in done:
                continue  # a weight shared by two sublayers is set once
            if p.role in ("q", "k") and beta_mode != "init":
                continue
            done.add(key)
            _beta(model, p, 1.0 if p.role in ("q", "k") else b, beta_mode, generator)
    return records


def _beta(model: nn.Module, p: Proj, gain: float, mode: str, generator: torch.Generator | None) -> None:
    w = owned(model, model.get_parameter(p.weight))  # written in place below: the rewrite's own copy
    bias_name = p.weight[: -len("weight")] + "bias" if p.weight.endswith("weight") else None  # in_proj_bias too
    try:
        bias = owned(model, model.get_parameter(bias_name)) if bias_name else None
    except AttributeError:
        bias = None
    with torch.no_grad():
        view = w if p.rows is None else w.narrow(p.out_axis, p.rows[0], p.rows[1] - p.rows[0])
        if mode == "init":
            # w  =>  xavier_normal(gain); the slice of a fused weight is initialized as its own matrix
            fresh = torch.empty(view.shape, dtype=torch.float32)
            std = gain * math.sqrt(2.0 / (view.shape[0] + view.shape[1]))
            fresh.normal_(0.0, std, generator=generator)
            view.copy_(fresh.to(view.dtype))
        else:
            # w  =>  beta * w, b  =>  beta * b   (torchscale divides every matching parameter)
            view.mul_(gain)
            if bias is not None:
                bview = bias if p.rows is None else bias.narrow(0, p.rows[0], p.rows[1] - p.rows[0])
                bview.mul_(gain)



class DeepNormPass(Pass):
    """LN(x + f(x)) -> LN(alpha * x + f(x)) at every post-LN sublayer: not exact, it changes what the model computes;
    verified against that formula computed literally on the same weights (``reference``)."""

    name = NAME
    check = Check.REFERENCE
    reference_label = "LN(alpha*x + f(x))"

    def __init__(self, arch: str | None = None, alpha: float | None = None, beta: float | None = None,
                 beta_mode: str = "init", n_layers: int | None = None, m_layers: int | None = None,
                 seed: int | None = 0, value_proj: Sequence[str] = (), out_proj: Sequence[str] = ()):
        if beta_mode not in BETA_MODES:
            raise NormconvError(f"unknown beta mode {beta_mode!r}; choose from: {', '.join(BETA_MODES)}")
        for label, v in (("alpha", alpha), ("beta", beta)):
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise NormconvError(f"--{label} must be a positive number (got {v})")
        for label, v in (("--layers", n_layers), ("--decoder-layers", m_layers)):
            if v is not None and v < 1:
                raise NormconvError(f"{label} must be >= 1 (got {v})")
        self.arch, self.alpha, self.beta, self.beta_mode = arch, alpha, beta, beta_mode
        self.n_layers, self.m_layers, self.seed = n_layers, m_layers, seed
        self.named = {"v": tuple(value_proj), "out": tuple(out_proj)}  # user-named roles (module patterns)

    def _analyze(self, cap: Captured, norms: Sequence[NormSite]) -> Analysis:
        return analyze(cap, norms, self.arch, self.n_layers, self.m_layers, self.beta_mode, self.named)

    def plan(self, cap: Captured, norms: Sequence[NormSite]) -> list[Site]:
        return sites_of(self._analyze(cap, norms), self.beta_mode)

    def refusal(self, cap: Captured, norms: Sequence[NormSite]) -> str | None:
        """Why DeepNorm does not apply to the captured model at all (pre-LN, no post-LN residual), or None."""
        return self._analyze(cap, norms).refusal

    def __call__(self, model: nn.Module, cap: Captured) -> PassResult:
        why = already_applied(model)
        if why:
            raise NormconvError(why, Code.REFUSED, pass_name=NAME)
        an = self._analyze(cap, find_norms(cap))
        sites = sites_of(an, self.beta_mode)
        if an.refusal:
            raise NormconvError(an.refusal, Code.REFUSED, pass_name=NAME)
        bad = [s for s in an.sublayers if s.problem]
        if bad:
            raise NormconvError(f"{len(bad)} of {len(an.sublayers)} post-LN sites cannot be rewritten, first "
                                f"{bad[0].norm.target}: {bad[0].problem} (a partial DeepNorm would mix scaled "
                                f"and unscaled residuals)", Code.REFUSED, pass_name=NAME)
        gen = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        records = _apply(model, an, self.beta_mode, self.alpha, self.beta, gen)
        stacks = {k: {"layers": an.layers[k], "counted_from": an.counted_from[k],
                      "alpha": self.alpha if self.alpha is not None else v[0],
                      "beta": self.beta if self.beta is not None else v[1]}
                  for k, v in an.consts.items()}
        model.__dict__[MARKER] = {"arch": an.arch, "beta_mode": self.beta_mode,
                                  "alpha": {k: v["alpha"] for k, v in stacks.items()},
                                  "beta": {k: v["beta"] for k, v in stacks.items()},
                                  "layers": dict(an.layers), "sites": records}
        return PassResult(model, True, tuple(sites), exact=False,
                          extra={"analysis": an, "stacks": stacks, "capture_method": cap.method, "records": records})

    def reference(self, rewritten: nn.Module) -> nn.Module:
        """LN(alpha * x + f(x)) computed literally on the rewritten model's weights."""
        return reference_model(rewritten)

# ---------------------------------------------------------------------------------------------------------
# reference check: LN(alpha * x + f(x)) computed literally on the same weights


def reference_model(rewritten: nn.Module) -> nn.Module:
    """A copy of a DeepNorm'ed model computing LN_eps(alpha * x + f(x)) literally: hooks removed, eps restored,
    x recovered at each norm as (x + f) - f in float64 from the recorded branch output f."""
    ref = clone_sharing_tensors(rewritten)  # hooks and eps change, no tensor is written
    mark = ref.__dict__.pop(MARKER)
    modules = dict(ref.named_modules())
    # normconv's hooks, or on the recorded sites their torch-only GraphModule form in a written model
    sited = {rec[key] for rec in mark["sites"] for key in ("norm", "branch")}
    for path, m in modules.items():
        for hooks in (m._forward_hooks, m._forward_pre_hooks):
            for k in [k for k, h in hooks.items() if isinstance(h, (BranchScale, InputScale))
                      or (path in sited and isinstance(h, torch.fx.GraphModule))]:
                del hooks[k]
    for rec in mark["sites"]:
        norm, branch = modules[rec["norm"]], modules[rec["branch"]]
        if rec["how"] == "eps":
            norm.eps = rec["eps"]
        box: dict[str, torch.Tensor] = {}
        branch.register_forward_hook(_Record(box))
        norm.register_forward_pre_hook(_Literal(box, rec["alpha"]))
    return ref


class _Record:
    def __init__(self, box):
        self.box = box

    def __call__(self, module, args, output):
        self.box["f"] = output[0] if isinstance(output, tuple) else output


class _Literal:
    def __init__(self, box, alpha):
        self.box, self.alpha = box, alpha

    def __call__(self, module, args):
        z, f = args[0], self.box.pop("f")
        x = z.double() - f.double()
        return ((self.alpha * x + f.double()).to(z.dtype),) + tuple(args[1:])


def check_against_reference(rewritten: nn.Module, inputs: Inputs, atol: float | None = None,
                            rtol: float | None = None) -> Validation:
    """Rewritten model vs the literal LN(alpha * x + f(x)) on the same weights (eval mode)."""
    ref = reference_model(rewritten)
    return compare(run(ref, inputs), run(rewritten, inputs), atol, rtol, label="reference LN(alpha*x + f(x))")


__all__ = ["DeepNormPass", "DeepNormWhy", "analyze", "plan", "constants", "already_applied", "reference_model",
           "check_against_reference", "BranchScale", "InputScale", "MARKER"]
