#!/usr/bin/env python
"""One peer of benchmarks/gpu_bench.py, in its own process: the bench's Llama written plainly in
PyTorch (nanoGPT style) or as Hugging Face's LlamaForCausalLM, trained for the spec's steps and
timed; the result goes to the JSON file the spec names.

    python benchmarks/gpu_bench_peers.py SPEC.json   # written by gpu_bench.py's run_peer
"""
from __future__ import annotations

import json
import sys
import time


def build_plain(shape: dict):
    """The Llama of `shape` written the ordinary way (nanoGPT style): fp32 parameters."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    h, n, f, s, V = shape["hidden"], shape["heads"], shape["ffn"], shape["seq"], shape["vocab"]
    d, eps = h // n, 1e-5

    def rope(x, cos, sin):  # rotate-half RoPE over each head's channels (as Llama / HF)
        x1, x2 = x.chunk(2, dim=-1)
        return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.mlp_norm = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
            self.wq, self.wk, self.wv = (nn.Linear(h, n * d, bias=False) for _ in range(3))
            self.wo = nn.Linear(n * d, h, bias=False)
            self.w_gate, self.w_up = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
            self.w_down = nn.Linear(f, h, bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            y = F.rms_norm(x, (h,), self.attn_norm, eps)
            q, k, v = (w(y).view(B, T, n, d).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            o = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
            x = x + self.wo(o.transpose(1, 2).reshape(B, T, n * d))
            y = F.rms_norm(x, (h,), self.mlp_norm, eps)
            return x + self.w_down(F.silu(self.w_gate(y)) * self.w_up(y))

    class PlainLlama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, h)
            self.blocks = nn.ModuleList(Block() for _ in range(shape["layers"]))
            self.norm = nn.Parameter(torch.ones(h))
            self.lm_head = nn.Linear(h, V, bias=False)
            inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)
            ang = torch.cat([ang, ang], dim=-1)
            self.register_buffer("cos", ang.cos(), persistent=False)
            self.register_buffer("sin", ang.sin(), persistent=False)
            for mod in self.modules():
                if isinstance(mod, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(mod.weight, std=0.02)

        def forward(self, tokens):
            T = tokens.shape[1]
            x = self.embed(tokens)
            cos, sin = self.cos[:T], self.sin[:T]
            for blk in self.blocks:
                x = blk(x, cos, sin)
            return self.lm_head(F.rms_norm(x, (h,), self.norm, eps))

    return PlainLlama()


def build_hf(shape: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["heads"], max_position_embeddings=shape["seq"], rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                      attention_dropout=0.0, use_cache=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        raise RuntimeError(f"Hugging Face chose attention {impl!r}, not sdpa")
    return model


def peer_main(spec_path: str) -> int:
    """Inside a peer's own process: build, step, time; the result as JSON next to the spec."""
    import torch
    import torch.nn.functional as F

    with open(spec_path) as f:
        spec = json.load(f)
    shape, dev = spec["shape"], torch.device(spec["device"])
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    with torch.device(dev):
        model = build_plain(shape) if spec["kind"] == "plain" else build_hf(shape)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=cuda)
    fwd = model
    if spec["compile"] == "model":
        fwd = torch.compile(model)
    elif spec["compile"]:  # each transformer block, as our --compile: one compiled graph serves every layer
        for blk in (model.blocks if spec["kind"] == "plain" else model.model.layers):
            blk.compile()
    mb, T, V = spec["micro_batch"], shape["seq"], shape["vocab"]
    g = torch.Generator(device=dev).manual_seed(1)
    data = [torch.randint(0, V, (mb, T + 1), device=dev, generator=g) for _ in range(4)]

    def logits_of(tokens):
        out = fwd(tokens) if spec["kind"] == "plain" else fwd(input_ids=tokens, use_cache=False).logits
        return out

    def step(i):
        batch = data[i % len(data)]
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = logits_of(batch[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, V), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    times, losses = [], []  # peak memory from the process start: weights, gradients, Adam state, activations
    for i in range(spec["warmup"] + spec["iters"]):
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        losses.append(step(i))
        if cuda:
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated(dev) / 2**30
    else:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    res = {"param_count": n_params, "step_times": times, "losses": losses, "peak_memory_gib": peak}
    with open(spec["result"], "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(peer_main(sys.argv[1]))
