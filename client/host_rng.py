"""Python's and numpy's global random generators as snapshot tensors, and back; and a
generator of the script's own registered as state (`GeneratorState`).

torch's generators are captured beside these. A data set's augmentation often draws
from the other two (`random.random()`, `np.random.normal()`): without them a spare, or a
survivor redoing a step, would draw other numbers than the uninterrupted run did.

Each state is one int64 tensor, so it travels as raw bytes like every other tensor:
python `[version, *internal state (625 words), has_gauss, gauss as float64 bits]`,
numpy (MT19937 only, captured once numpy is imported) `[pos, has_gauss, gauss bits,
*key (624 words)]`.
"""

from __future__ import annotations

import array
import random
import struct
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["GeneratorState", "load", "states"]


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def states() -> dict[str, torch.Tensor]:
    """`{"python": tensor, "numpy": tensor}` (numpy only when imported and MT19937).
    A generator nobody drew from since the last call gives the same tensor again."""
    python = random.getstate()
    out = {"python": _kept("python", python, lambda: _python_words(python))}
    np = sys.modules.get("numpy")
    if np is not None:
        state = np.random.get_state(legacy=False)
        if state["bit_generator"] == "MT19937":
            inner = state["state"]
            key = (inner["pos"], state["has_gauss"], state["gauss"], inner["key"].tobytes())
            out["numpy"] = _kept("numpy", key, lambda: _numpy_words(state))
    return out


_last: dict[str, tuple[Any, torch.Tensor]] = {}


def _kept(name: str, key: Any, words: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The tensor made for `key` last time, or a new one from `words()`."""
    last = _last.get(name)
    if last is None or last[0] != key:
        last = _last[name] = (key, words())
    return last[1]


def _python_words(state: tuple[int, tuple[int, ...], float | None]) -> torch.Tensor:
    version, internal, gauss = state
    words = array.array("q", (version, *internal, gauss is not None, _bits(gauss or 0.0)))
    return torch.frombuffer(words, dtype=torch.int64)


def _numpy_words(state: dict[str, Any]) -> torch.Tensor:
    import numpy as np

    inner = state["state"]
    head = np.array([inner["pos"], state["has_gauss"], _bits(state["gauss"])], dtype=np.int64)
    return torch.from_numpy(np.concatenate([head, inner["key"].astype(np.int64)]))


def _python_state(words: list[int]) -> tuple[int, tuple[int, ...], float | None]:
    return words[0], tuple(words[1:-2]), _float(words[-1]) if words[-2] else None


class GeneratorState:
    """A generator of the script's own registered as state (`state={"rng": g}`): a
    `torch.Generator`, a `random.Random` or a numpy `Generator`, whose state is captured
    and set back like the global ones."""

    KINDS = "a torch.Generator, a random.Random or a numpy.random.Generator"

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    @staticmethod
    def takes(obj: Any) -> bool:
        """Whether `obj` is such a generator (random.SystemRandom, which draws from the
        operating system and has no state, is not)."""
        numpy_generator = (type(obj).__module__.startswith("numpy.random")
                           and hasattr(obj, "bit_generator"))
        python = isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom)
        return isinstance(obj, torch.Generator) or python or numpy_generator

    def state_dict(self) -> dict[str, Any]:
        g = self.generator
        if isinstance(g, torch.Generator):
            return {"state": g.get_state()}
        if isinstance(g, random.Random):
            return {"state": _python_words(g.getstate()).clone()}
        # A numpy bit generator's state: plain values and arrays (MT19937's key,
        # Philox's buffer), which travel as lists.
        return {"numpy": _plain(g.bit_generator.state)}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        g = self.generator
        if isinstance(g, torch.Generator):
            g.set_state(saved["state"])
        elif isinstance(g, random.Random):
            g.setstate(_python_state(saved["state"].tolist()))
        else:
            g.bit_generator.state = dict(saved["numpy"])


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value.tolist() if hasattr(value, "tolist") else value


def load(saved: Mapping[str, torch.Tensor]) -> None:
    """Set the generators `states()` captured; one absent from `saved` is left as is
    (a step captured before it was imported, or imported from a checkpoint)."""
    if "python" in saved:
        random.setstate(_python_state(saved["python"].tolist()))
    if "numpy" in saved:
        import numpy as np

        words = saved["numpy"].tolist()
        np.random.set_state({"bit_generator": "MT19937",
                             "state": {"key": np.array(words[3:], dtype=np.uint32),
                                       "pos": words[0]},
                             "has_gauss": words[1], "gauss": _float(words[2])})
