"""Model execution on the worker thread: ForwardBatch (the step's inputs) and ModelRunner
(model + KV cache + attention backend + sampling)."""

from pyserve.forward_batch_info import ForwardBatch, ForwardMode, SamplingBatchInfo

__all__ = ["ForwardBatch", "ForwardMode", "SamplingBatchInfo", "ModelRunner"]


def __getattr__(name: str):
    # Lazy, so importing ForwardBatch does not pull in torch models and loaders.
    if name == "ModelRunner":
        from pyserve.model_executor.model_runner import ModelRunner

        return ModelRunner
    raise AttributeError(name)
