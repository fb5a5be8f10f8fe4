"""The built-in strategies: one module each, registered on import.

This file is the registry's list: a new strategy is its module plus one line here. The order is
the order of the benchmark's and the report's tables.
"""

# isort: off
from . import fedavg, fedprox, static, mix, phased, random_split, resource, planner, fedsga, musplitfed, fedmut, fedbabu, fedgh, fedas, multisfl, mergesfl  # noqa: F401  (registration)
