"""The copies of a model's block weights that its prompt formats read (chapter 3): `model.weight_copies`.

A bf16 prompt multiplies each block weight's bf16 copy (bf16_copies.py), an int8 prompt its int8
codes and scales (w8a8.py). Each model holds its own `WeightCopies`, made empty with the model
(Model.__init__) and again whenever its tensors are cast or moved (Model._apply), and filled by the
first prompt of each format (precision.prompt_format). The copies live as long as the model: nothing
outside it keeps them.

Each table is keyed by the weight itself (a Parameter or a QuantizedWeight), weakly: a weight that is
dropped takes its copy with it, and a weight without a copy (the output head) is not a key.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .weight_quant import QuantizedWeight


def version(w) -> int:
    """The version counter of the tensor that holds w's numbers (in-place writes bump it)."""
    return (w.codes if isinstance(w, QuantizedWeight) else w)._version


class WeightCopies:
    """One model's copies of its block weights: bf16 (bf16_copies.py) and int8 (w8a8.py)."""

    def __init__(self, calibration: Callable[[], Tensor] | None = None):
        self.bf16 = WeakIdKeyDictionary()  # weight -> (its version when copied, the bf16 copy)
        self.int8 = WeakIdKeyDictionary()  # weight -> its w8a8.Int8Weight
        self.calibration = calibration  # () -> the ids an int8 prompt calibrates on (w8a8.calibrate_on), or None

    def bf16_of(self, w) -> Tensor | None:
        """w's bf16 copy, or None (none made: the head, a bf16 weight, a model whose bf16 prompt has
        not run; or stale: w was written since the copy was made)."""
        kept = self.bf16.get(w)
        if kept is None or kept[0] != version(w):
            return None
        return kept[1]

    def int8_of(self, w):
        """w's int8 copy (w8a8.Int8Weight), or None (the head; a model whose int8 prompt has not run)."""
        return self.int8.get(w)

    def emptied(self) -> "WeightCopies":
        """A new, empty WeightCopies that calibrates as this one does (Model._apply: the weights changed)."""
        return WeightCopies(self.calibration)

    def __deepcopy__(self, memo) -> "WeightCopies":
        """A deep copy of a model holds new weights, which may then change (offgrid.rotate): no copies."""
        return self.emptied()
