"""The name of :mod:`vitattn.vitdet` before 0.2 (it was easy to mistake for the training task,
``vitattn.training.detect``). Importing it warns once and gives that very module; removed in 0.3."""

import sys
import warnings

from . import vitdet

warnings.warn("vitattn.detection is now vitattn.vitdet (the same module); the old name goes in 0.3",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = vitdet
