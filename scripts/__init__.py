"""Tools users run: the real 32k models (fetch_models), DoubleSparse's calibration (calibrate_doublesparse),
bits per character of each weight format (quant_bpc), the prepared GPU calls (gpu_contact.sh). One-off
studies are in scripts/studies/."""
