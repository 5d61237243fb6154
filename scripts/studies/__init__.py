"""One-off studies kept with their records (docs/NOTES.md): run with python -m scripts.studies.NAME."""
