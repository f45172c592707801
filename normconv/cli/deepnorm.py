"""``normconv deepnorm``: DeepNorm residual rescaling LN(alpha*x + f(x)) and beta init for deep post-LN transformers."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from normconv.cli.common import (AcceptSpecializedOpt, OverwriteOpt, TrustCodeOpt, KeepNormconvOpt, AtolOpt, DtypeOpt, InputShapeOpt, JsonOpt, ModelArg, OutputOpt, RtolOpt, TrustOpt,
                         WeightsOpt, emit, load_from_flags, options_from_flags, user_errors)
from normconv.errors import NormconvError


def register(app: typer.Typer) -> None:
    @app.command()
    @user_errors
    def deepnorm(
        model: ModelArg,
        output: OutputOpt = None,
        arch: Annotated[Optional[str], typer.Option(
            "--arch", help="encoder, decoder or encoder-decoder (default: read from the graph)")] = None,
        init: Annotated[bool, typer.Option("--init", help="beta: re-initialize FFN, v and out weights with Xavier "
                                                         "normal gain beta, q and k gain 1 (default)")] = False,
        rescale: Annotated[bool, typer.Option("--rescale", help="beta: multiply the existing FFN, v and out "
                                                               "weights (and biases) by beta")] = False,
        no_beta: Annotated[bool, typer.Option("--no-beta", help="beta: leave the weights as they are")] = False,
        alpha: Annotated[Optional[float], typer.Option("--alpha", help="override alpha (every stack)")] = None,
        beta: Annotated[Optional[float], typer.Option("--beta", help="override beta (every stack)")] = None,
        layers: Annotated[Optional[int], typer.Option(
            "--layers", help="N: encoder layers (or the layers of a decoder-only stack); default counted")] = None,
        decoder_layers: Annotated[Optional[int], typer.Option(
            "--decoder-layers", help="M: decoder layers of an encoder-decoder; default counted")] = None,
        seed: Annotated[int, typer.Option("--seed", help="random seed of --init")] = 0,
        value_proj: Annotated[Optional[list[str]], typer.Option(
            "--value-proj", help="module name pattern (fnmatch, repeatable) of attention value projections the "
                                 "graph does not identify, e.g. 'encoder.layer.*.attention.value'")] = None,
        out_proj: Annotated[Optional[list[str]], typer.Option(
            "--out-proj", help="module name pattern (fnmatch, repeatable) of attention output projections")] = None,
        weights: WeightsOpt = None,
        input_shape: InputShapeOpt = None,
        trust_pickle: TrustOpt = False,
        trust_remote_code: TrustCodeOpt = False,
        dtype: DtypeOpt = None,
        atol: AtolOpt = None,
        rtol: RtolOpt = None,
        normconv_modules: KeepNormconvOpt = False,
        accept_specialized: AcceptSpecializedOpt = False,
        overwrite: OverwriteOpt = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Make a post-LN transformer DeepNorm: LN(alpha*x + f(x)) at every post-LN sublayer, beta on FFN/v/out.

        The model changes (it is for (re)training); it is checked against LN(alpha*x + f(x)) computed literally
        on the same weights, and written only if that check passes."""
        from normconv.commands.deepnorm import deepnorm as run

        modes = [m for m, on in (("init", init), ("rescale", rescale), ("none", no_beta)) if on]
        if len(modes) > 1:
            raise NormconvError("choose one of --init, --rescale, --no-beta")
        beta_mode = modes[0] if modes else "init"
        if beta is not None and beta_mode == "none":
            raise NormconvError("--beta has no effect with --no-beta")
        loaded = load_from_flags(model, weights, input_shape, trust_pickle, dtype, trust_remote_code)
        report, _ = run(loaded, options_from_flags(output, atol, rtol, normconv_modules=normconv_modules,
                                                   accept_specialized=accept_specialized, overwrite=overwrite),
                        arch=arch,
                        alpha=alpha, beta=beta, beta_mode=beta_mode, n_layers=layers, m_layers=decoder_layers,
                        seed=seed, value_proj=value_proj or (), out_proj=out_proj or ())
        emit(report, as_json)
