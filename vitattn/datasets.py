"""The name of :mod:`vitattn.constants` before 0.2 (it was easy to mistake for the data pipeline,
``vitattn.training.data``). Importing it warns once and gives that very module; removed in 0.3."""

import sys
import warnings

from . import constants

warnings.warn("vitattn.datasets is now vitattn.constants (the same module); the old name goes in 0.3",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = constants
