import sys

sys.path.insert(0, "benchmarks")
import torch
from kernels_bench import _timed, decode_layers_case

sms = torch.cuda.get_device_properties(0).multi_processor_count
def ceil_rule(bs, kvh): return max(1, min(8, -(-2 * sms // (bs * kvh))))
def floor_rule(bs, kvh): return max(1, min(8, (2 * sms) // (bs * kvh)))
print("| bs | ctx | layers | current (ceil, 64,4,2) | ceil, 128,4,3 | floor, 128,4,3 | floor, 64,4,2 |")
for ctx in (384, 640, 2048):
    for bs in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        layers = int(max(4, min(36, 16e9 // (bs * ctx * 4096 * 2))))
        if bs * ctx * 4096 * 2 * layers > 40e9: continue
        c, f = ceil_rule(bs, 8), floor_rule(bs, 8)
        cells = []
        for s, t in ((c, (64, 4, 2)), (c, (128, 4, 3)), (f, (128, 4, 3)), (f, (64, 4, 2))):
            r = _timed(decode_layers_case, bs, ctx, 32, 8, layers, s, t)
            cells.append(f"{r:.2f} ({s})" if r else "n/a")
        print(f"| {bs} | {ctx} | {layers} | " + " | ".join(cells) + " |", flush=True)
        torch.cuda.empty_cache()
