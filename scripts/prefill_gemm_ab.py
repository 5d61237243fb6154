"""A/B of gemv-q8's prefill in one process, alternating: the integer GEMM (qlinear.q8_gemm_pays's choice) against
dequantize + F.linear, over a quantized checkpoint's gemv-q8 linears on T random rows (docs/NOTES.md, Linear layers).

    python -m scripts.prefill_gemm_ab CHECKPOINT.pth T DTYPE      # e.g. checkpoints/SmolLM2-135M-Instruct/model_int4.g32.pth 2048 bfloat16
"""
import statistics
import sys
import time

import torch

import kernels
import model as M
import qlinear as Q
import quantize as QZ


def main(checkpoint: str, rows: int, dtype_name: str, rounds: int = 5) -> None:
    dtype = getattr(torch, dtype_name)
    error = kernels.cpu_kernel_error()
    if error is not None:
        raise SystemExit(f"prefill_gemm_ab: the fused CPU kernels are unavailable ({error})")
    model = M.load_model(checkpoint, dtype=dtype, kernels=kernels.CPU_KERNELS, quantized=QZ.loading("gemv-q8"))
    layers = [m for m in model.modules() if isinstance(m, Q.QuantizedLinear) and m.kernel == "gemv-q8"]
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k in {m.in_features for m in layers}}
    times = {True: [], False: []}
    with torch.no_grad():
        for _ in range(rounds):
            for gemm in (True, False):
                for m in layers:
                    m.prefill_gemm = gemm
                start = time.perf_counter()
                for m in layers:
                    m(inputs[m.in_features])
                times[gemm].append(time.perf_counter() - start)
    gemm, dequant = (statistics.median(times[g]) * 1e3 for g in (True, False))
    print(f"{len(layers)} gemv-q8 linears, T = {rows}, {dtype_name} x, {torch.ops.sparq.linear_q8_path()} path: integer "
          f"GEMM {gemm:.0f} ms, dequantize + F.linear {dequant:.0f} ms (medians of {rounds}): GEMM {dequant / gemm:.2f}x; "
          f"q8_gemm_pays says {Q.q8_gemm_pays(rows, dtype)}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
