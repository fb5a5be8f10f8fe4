"""The built-in strategies: one module each, registered on import.

This file is the registry's list: a new strategy is its module plus one line here.
"""

from . import fedavg, fedprox, fedsga, random_split, resource, static  # noqa: F401  (registration)
