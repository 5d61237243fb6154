"""Speed: `python -m bench {attention,decode,linear}` and the GPU check (`python -m bench.gpu_check`)."""
