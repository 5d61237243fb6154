"""Run by tests/test_kernels_triton.py without a GPU (TRITON_INTERPRET unset): the real Triton compiler
lowers every kernel of the launch plans to sm_90 cubin with the parameters the wrappers pick, and ptxas
reports no large spills. On a GPU machine: PYTHONPATH=. python tests/compile_for_h100.py"""
import subprocess, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
import kernels_triton as kt
import kernels_triton_jit as jit

target = GPUTarget("cuda", 90, 32)
cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
I32 = {"pos_ptr", "key_ptr", "pos_in_ptr", "key_in_ptr", "idx_ptr"}
KDT = {"q_ptr", "k_ptr", "v_ptr", "out_ptr"}
seen = set()

def compile_one(kernel, config, kdt, ptrs=None, **constexprs):
    """ptrs: pointer types other than the defaults (a quantized cache's k_ptr / v_ptr: i8, or u8 for an int4 K^T)."""
    config = dict(config)
    ptrs = ptrs or {}
    options = dict(num_warps=config.pop("num_warps"), num_stages=config.pop("num_stages"))
    constexprs.update({k: v for k, v in config.items() if k in kernel.arg_names})
    for name, default in (("QUANT", 0), ("INT8_KV", False)):  # a float cache unless said
        if name in kernel.arg_names:
            constexprs.setdefault(name, default)
    key = (kernel.__name__, kdt, tuple(sorted(ptrs.items())), tuple(sorted(constexprs.items())),
           tuple(sorted(options.items())))
    if key in seen:
        return
    seen.add(key)
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "live":
            signature[name] = {0: "i32", 1: "*i64", 2: "*i32"}[constexprs["LIVE"]]
        elif name.endswith("_ptr"):
            signature[name] = "*" + ptrs.get(name, kdt if name in KDT else "i32" if name in I32 else "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "sm_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride"):  # S_max and d multiples of 16, as in aligned caches
                attrs[(i,)] = [["tt.divisibility", 16]]
    jobs.append((kernel.__name__, signature, constexprs, attrs, options, kdt))

def compile_job(job):
    name, signature, constexprs, attrs, options, kdt = job
    kernel = getattr(kt, name)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options)
    usage = ""
    if cuobjdump.is_file():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"]); f.flush()
            out = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        usage = " ".join(w for w in out.split() if w.startswith(("REG:", "STACK:", "LOCAL:")))
        stack = int(usage.split("STACK:")[1].split()[0]) if "STACK:" in usage else 0
        assert stack <= 64, f"{name} {constexprs} spills: {usage}"
    return f"{name} {kdt} {constexprs} {options} {usage}"

jobs = []

# (B, n_kv, g, d, S_bound, k): Table 4 MHA; Llama-2 / Llama-3 shapes at B = 1, long S (chunks, merge,
# split step 2, split dense); small GQA d = 80 fp32; small MHA d = 64 fp16.
SHAPES = [((64, 32, 1, 128, 4096, 128), "bf16"), ((1, 32, 1, 128, 32768, 128), "bf16"),
          ((1, 8, 4, 128, 131072, 128), "bf16"), ((3, 2, 3, 80, 1000, 128), "fp32"), ((1, 2, 1, 64, 129, 16), "fp16")]
for (B, n_kv, g, d, S, k), kdt in SHAPES:
    p = kt.sparq_plan(B, n_kv, g, d, S, min(k, S), kdt != "fp32")
    first = S == 4096  # variants that change no tile: compiled for one shape only
    compile_one(jit._sparq_rank_kernel, p["rank"], kdt)
    for k_transposed in ((True, False) if first or g > 1 else (True,)):
        compile_one(jit._sparq_step1_kernel, p["step1"], kdt, K_TRANSPOSED=k_transposed, LIVE=1)
    if first:
        compile_one(jit._sparq_step1_kernel, p["step1"], kdt, K_TRANSPOSED=True, LIVE=0)
    compile_one(jit._sparq_select_kernel, p["select"], kdt, LIVE=2)
    if p["merge"]:
        compile_one(jit._sparq_merge_kernel, p["merge"], kdt)
    compile_one(jit._sparq_step2_kernel, p["step2"], kdt, MEAN_V=True, LIVE=1)
    if first:
        compile_one(jit._sparq_step2_kernel, p["step2"], kdt, MEAN_V=False, LIVE=0)
    if p["combine"]:
        compile_one(jit._combine_kernel, p["combine"], kdt, MEAN_V=True, LIVE=2)
    dp = kt.dense_plan(B, n_kv, g, d, S, kdt != "fp32")
    compile_one(jit._dense_kernel, dp["dense"], kdt, LIVE=1)
    if dp["combine"]:
        compile_one(jit._combine_kernel, dp["combine"], kdt, MEAN_V=False, LIVE=2)

# a quantized cache (int8 K/V; an int8 or int4 K^T, or int8 K as step 1's source with one K): step 1's
# fp32 dots; step 2's and dense's native 16-bit dots under a bf16 q, fp32 ones under an fp32 q
for (B, n_kv, g, d, S, k), kdt in (((1, 8, 4, 128, 131072, 128), "bf16"), ((64, 32, 1, 128, 4096, 128), "bf16"),
                                   ((1, 8, 4, 128, 131072, 128), "fp32")):
    native = kdt != "fp32"
    p = kt.sparq_plan(B, n_kv, g, d, S, k, False, kv_native_dot=native)
    for quant, k_transposed, kptr in ((1, True, "i8"), (2, True, "u8"), (1, False, "i8")):
        compile_one(jit._sparq_step1_kernel, p["step1"], kdt, {"k_ptr": kptr}, K_TRANSPOSED=k_transposed, LIVE=1,
                    QUANT=quant)
    compile_one(jit._sparq_step2_kernel, p["step2"], kdt, {"k_ptr": "i8", "v_ptr": "i8"}, MEAN_V=True, LIVE=1,
                INT8_KV=True)
    dp = kt.dense_plan(B, n_kv, g, d, S, native)
    compile_one(jit._dense_kernel, dp["dense"], kdt, {"k_ptr": "i8", "v_ptr": "i8"}, LIVE=1, INT8_KV=True)

# the verify pass (speculative decoding): T = 5 queries folded into the heads, per-row live lengths
for (B, n_kv, g, d, S), kdt in (((1, 8, 4 * 5, 128, 131072), "bf16"), ((8, 32, 1 * 5, 128, 4096), "bf16")):
    dp = kt.dense_plan(B, n_kv, g, d, S, True)
    compile_one(jit._dense_kernel, dp["dense"], kdt, LIVE=2)

if __name__ == "__main__":  # a process per core: each kernel compiles single-threaded
    import concurrent.futures, os
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for line in pool.map(compile_job, jobs):
            print(line)
