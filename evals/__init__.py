"""The accuracy harness: `python -m evals` (evals/__main__.py), its runner, report and tasks."""
