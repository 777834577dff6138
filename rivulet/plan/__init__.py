"""Planning parallel layouts: `rivulet plan` (cluster.py, cost.py, planner.py, probe.py, cli.py)."""
