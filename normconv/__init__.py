"""normconv: rewrite the normalization layers of existing PyTorch models and ship them to deployment."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("normconv")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"

__all__ = ["__version__"]
