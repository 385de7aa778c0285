"""pyserve: a readable, embeddable LLM inference server.

Public API: `Engine` (in-process generation), `ServerArgs` (configuration), `SamplingParams`,
`create_app` (the ASGI app) and the exceptions in `pyserve.errors`.
"""

from importlib import metadata as _metadata

from pyserve.config import ServerArgs, ServerArgsError
from pyserve.errors import InvalidRequestError, ModelStepError, QueueFullError
from pyserve.sampling_params import SamplingParams

try:
    __version__ = _metadata.version("pyserve")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"


def __getattr__(name: str):  # lazy: importing pyserve must not import torch
    if name == "Engine":
        from pyserve.entrypoints.engine import Engine

        return Engine
    if name == "create_app":
        from pyserve.server.app import create_app

        return create_app
    raise AttributeError(f"module 'pyserve' has no attribute {name!r}")


__all__ = [
    "__version__",
    "Engine",
    "ServerArgs",
    "ServerArgsError",
    "SamplingParams",
    "create_app",
    "InvalidRequestError",
    "ModelStepError",
    "QueueFullError",
]
