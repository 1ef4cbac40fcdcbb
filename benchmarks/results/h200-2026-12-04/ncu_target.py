import torch, torch.nn.functional as F
from zipserv_vllm.kernels import cuda
m, k = 28672, 4096
w = (torch.randn(m, k, device="cuda") * 0.02).to(torch.bfloat16)
ct = cuda.compress_tensor_cuda(w)
args = (ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, m, k, None)
xs = {n: torch.randn(n, k, device="cuda").to(torch.bfloat16) for n in (1, 8)}
for n, x in xs.items():  # warm: validation, kernel attributes, cuBLAS handles
    cuda.fused_gemm(x, *args, 8, 1); F.linear(x, w)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for n, x in xs.items():
    cuda.fused_gemm(x, *args, 8, 1)
    F.linear(x, w)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("weights per launch", m * k, "compressed bytes", ct.nbytes, "bf16 bytes", m * k * 2)
