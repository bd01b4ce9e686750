"""Experiments run on coplan's own planner and cost model (``coplan coupling``).

- ``coupling``: how strongly fusion, remat, parallelism and precision couple, on a grid of
  scenarios, from the cost model (every plan priced by it and checked by the plan checker);
- ``coupling_measure``: fusion x remat measured on real training (this CPU, or a GPU);
- ``coupling_report``: the Rich tables and the self-contained HTML report.
"""
