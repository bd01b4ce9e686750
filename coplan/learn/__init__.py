"""The learned planner: training jobs sampled and labelled by coplan's own planners
(``jobs.py``, ``dataset.py``)."""
