"""Downloads and builds kept outside the repo: the real 32k models (fetch_models), llama.cpp (llamacpp)."""
