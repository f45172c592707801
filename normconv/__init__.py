"""normconv: rewrite the normalization layers of existing PyTorch models and ship them to deployment.

    import normconv
    folded, report = normconv.fold(model, example_inputs)
    swapped, report = normconv.swap(model, example_inputs, to="rmsnorm")
    frozen, report = normconv.swap(model, example_inputs, to="frozen-batchnorm")  # batchnorm, affine, groupnorm ...
    recalibrated, report = normconv.recalibrate(model, calibration_tensor)      # BatchNorm statistics re-estimated
    report = normconv.stream_swap("hf_folder", "out_folder")   # larger than RAM: tensor by tensor
    report = normconv.stream_fold("hf_folder", "out_folder")   # BatchNorm folded the same way
    new, report = normconv.canonicalize(model, example_inputs)
    rotated, report = normconv.rotate(model, example_inputs)
    new, report = normconv.deepnorm(model, example_inputs)
    report = normconv.export(model, example_inputs, "model.onnx")
    report = normconv.inspect(model, example_inputs)

The API (``normconv.api``) is imported on first use, so ``import normconv`` and ``normconv --version`` stay light.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("normconv")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"

_API = ("fold", "canonicalize", "swap", "recalibrate", "stream_swap", "stream_fold", "rotate", "deepnorm", "export", "inspect", "load", "Inputs", "NormconvError",
        "VerificationError")


def __getattr__(name: str):
    if name in ("NormconvError", "VerificationError"):
        from normconv import errors

        return getattr(errors, name)
    if name in _API:
        from normconv import api

        return getattr(api, name)
    raise AttributeError(f"module 'normconv' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_API))


__all__ = ["__version__", *_API]
