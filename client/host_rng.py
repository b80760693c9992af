"""Python's and numpy's global random generators as snapshot tensors, and back.

torch's generators are captured beside these. A data set's augmentation often draws
from the other two (`random.random()`, `np.random.normal()`): without them a spare, or a
survivor redoing a step, would draw other numbers than the uninterrupted run did.

Each state is one int64 tensor, so it travels as raw bytes like every other tensor:
python `[version, *internal state (625 words), has_gauss, gauss as float64 bits]`,
numpy (MT19937 only, captured once numpy is imported) `[pos, has_gauss, gauss bits,
*key (624 words)]`.
"""

from __future__ import annotations

import random
import struct
import sys
from collections.abc import Mapping

import torch

__all__ = ["load", "states"]


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def states() -> dict[str, torch.Tensor]:
    """`{"python": tensor, "numpy": tensor}` (numpy only when imported and MT19937)."""
    version, internal, gauss = random.getstate()
    out = {"python": torch.tensor([version, *internal, gauss is not None,
                                   _bits(gauss or 0.0)], dtype=torch.int64)}
    np = sys.modules.get("numpy")
    if np is not None:
        state = np.random.get_state(legacy=False)
        if state["bit_generator"] == "MT19937":
            key = torch.from_numpy(state["state"]["key"].astype(np.int64))
            head = torch.tensor([state["state"]["pos"], state["has_gauss"],
                                 _bits(state["gauss"])], dtype=torch.int64)
            out["numpy"] = torch.cat([head, key])
    return out


def load(saved: Mapping[str, torch.Tensor]) -> None:
    """Set the generators `states()` captured; one absent from `saved` is left as is
    (a step captured before it was imported, or imported from a checkpoint)."""
    if "python" in saved:
        words = saved["python"].tolist()
        gauss = _float(words[-1]) if words[-2] else None
        random.setstate((words[0], tuple(words[1:-2]), gauss))
    if "numpy" in saved:
        import numpy as np

        words = saved["numpy"].tolist()
        np.random.set_state({"bit_generator": "MT19937",
                             "state": {"key": np.array(words[3:], dtype=np.uint32),
                                       "pos": words[0]},
                             "has_gauss": words[1], "gauss": _float(words[2])})
