"""Speed: `python -m bench {attention,decode,linear,speculate,serve-load}`, the GPU check
(`python -m bench.gpu_check`) and llama.cpp built beside our figures (`python -m bench.llamacpp`)."""
