"""Probe: green contexts and MPS on this machine (what GPU sharing is possible)."""
import inspect, os, shutil, subprocess, sys, time
import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
      "SMs", torch.cuda.get_device_properties(0).multi_processor_count)
def bench(label):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / 10
    print(f"{label}: 8192^3 bf16 GEMM {2 * 8192**3 / dt / 1e12:.0f} TFLOP/s")
bench("whole GPU")
try:
    from torch.cuda.green_contexts import GreenContext
    print("GreenContext.create", inspect.signature(GreenContext.create))
    print("members", [m for m in dir(GreenContext) if not m.startswith("_")])
    try:
        ctx = GreenContext.create(num_sms=64, device_id=0)
    except TypeError:
        ctx = GreenContext.create(64, 0)
    if hasattr(ctx, "Stream"):
        s = ctx.Stream()
        with torch.cuda.stream(s):
            bench("green ctx 64 SMs via ctx.Stream()")
    else:
        ctx.set_context()
        bench("green ctx 64 SMs via set_context")
        ctx.pop_context()
    bench("after green ctx")
except Exception as e:
    print("green contexts FAILED:", type(e).__name__, e)
mps = shutil.which("nvidia-cuda-mps-control")
print("mps control:", mps, "compute mode:", subprocess.run(["nvidia-smi", "--query-gpu=compute_mode,driver_version,clocks.sm,clocks.mem", "--format=csv"], capture_output=True, text=True).stdout)
if mps:
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps-pipe", "CUDA_MPS_LOG_DIRECTORY": "/tmp/mps-log"}
    os.makedirs("/tmp/mps-pipe", exist_ok=True); os.makedirs("/tmp/mps-log", exist_ok=True)
    r = subprocess.run([mps, "-d"], env=env, capture_output=True, text=True, timeout=20)
    print("mps -d:", r.returncode, r.stdout, r.stderr)
    client = ("import torch,time;a=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16);[a@a for _ in range(3)];"
              "torch.cuda.synchronize();t=time.perf_counter();[a@a for _ in range(10)];torch.cuda.synchronize();"
              "print('MPS client 50%:', round(2*8192**3/((time.perf_counter()-t)/10)/1e12), 'TFLOP/s')")
    r = subprocess.run([sys.executable, "-c", client], env={**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"},
                       capture_output=True, text=True, timeout=60)
    print("client:", r.returncode, r.stdout[-500:], r.stderr[-1500:])
    r = subprocess.run([mps], input="quit\n", env=env, capture_output=True, text=True, timeout=20)
    print("mps quit:", r.returncode, r.stdout, r.stderr)
    print(open("/tmp/mps-log/control.log").read()[-1500:] if os.path.exists("/tmp/mps-log/control.log") else "no log")
