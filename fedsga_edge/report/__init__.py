"""Reports on runs, benchmarks and device profiles: ``fedsga-edge report`` and ``fedsga-edge plot``.

``runs`` finds and loads run folders and profiles, ``data`` computes what each plot shows (plain
data), ``plots`` draws one figure per plot (matplotlib, Agg), ``html`` writes the self-contained
page, ``build`` wires them. Nothing here imports torch or the roles.
"""

from .build import Report, build_report, plot_runs
from .runs import Run, RunError, discover, load_profile, load_run

__all__ = ["Report", "Run", "RunError", "build_report", "discover", "load_profile", "load_run", "plot_runs"]
