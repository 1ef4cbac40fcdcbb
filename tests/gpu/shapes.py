"""Layer shapes (M = out_features, K = in_features) of the models the GPU tests and benchmarks use."""

# merged QKV, O, merged gate+up, down
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}
LLAMA3_70B = {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}
QWEN25_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
QWEN25_14B = {"qkv": (7168, 5120), "o": (5120, 5120), "gate_up": (27648, 5120), "down": (5120, 13824)}

MODELS = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, "qwen2.5-7b": QWEN25_7B, "qwen2.5-14b": QWEN25_14B}

NS = (1, 2, 3, 8, 16, 17, 32, 64, 128, 129, 256, 1024, 8192)


def all_shapes():
    return [(f"{model}.{name}", m, k) for model, layers in MODELS.items() for name, (m, k) in layers.items()
            if name != "lm_head"]
