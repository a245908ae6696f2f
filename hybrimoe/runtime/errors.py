"""Errors of :class:`hybrimoe.Llama` that callers tell apart from its others."""
from __future__ import annotations


class DeviceLostError(RuntimeError):
    """A device of the Llama is gone (its RPC server disconnected or died): the Llama cannot compute any more and
    should be closed; a new one can be made once the device is back.

    Attributes:
        devices: what ggml's RPC client says of each lost device (``"RPC server HOST:PORT disconnected (Broken
            pipe, during SET_TENSOR)"``), one string per device.
        endpoints: the lost devices' ``HOST:PORT``.
    """

    def __init__(self, message: str, devices: list, endpoints: list):
        super().__init__(message)
        self.devices = list(devices)
        self.endpoints = list(endpoints)
