"""What a score call returns its arrays as: numpy for numpy (or array-like)
input, torch tensors on the input's device for torch input.

numpy outputs of a one-part call are read-only views of the response's
bytes (``np.frombuffer``, no copy); torch outputs are made from those
(``torch.from_numpy``, no copy; then ``.to(device)`` for a non-CPU input).
"""

import threading
import warnings
from typing import Any, Dict, Optional

import numpy as np

from .tensors import Array, is_torch

_warned = threading.Lock()
_warned_done = False


def _consume_readonly_warning(torch: Any) -> None:
    """torch.from_numpy warns once per process (TORCH_WARN_ONCE) that a
    read-only array (our view of the response's bytes, which nothing else
    references) gives a tensor that could write to it. That one warning is
    triggered here, on a dummy array, and swallowed; so the conversions
    never warn, whatever the caller's warning filters."""
    global _warned_done
    with _warned:
        if _warned_done:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.from_numpy(np.frombuffer(b"\0\0\0\0", dtype=np.float32))
        _warned_done = True


class OutputFormat:
    """numpy (``device is None``) or torch tensors on ``device``."""

    def __init__(self, device: Optional[Any] = None) -> None:
        self.device = device

    @classmethod
    def of(cls, x: Any) -> "OutputFormat":
        """The format of a call whose scores input (``logits`` /
        ``hidden_states``) is ``x``: torch on ``x.device`` for a torch
        tensor, else numpy."""
        if is_torch(x):
            return cls(x.device)
        return cls()

    @property
    def is_torch(self) -> bool:
        return self.device is not None

    def convert(self, outputs: Dict[str, Array]) -> Dict[str, Any]:
        """``{name: ndarray}`` -> the same as this format's arrays (torch:
        float32 / int64 tensors sharing the arrays' memory on the CPU)."""
        if self.device is None:
            return outputs
        import torch  # only reached for torch input

        _consume_readonly_warning(torch)
        out = {}
        for name, arr in outputs.items():
            t = torch.from_numpy(arr)
            if self.device.type != "cpu":
                t = t.to(self.device)
            out[name] = t
        return out
