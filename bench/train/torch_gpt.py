#!/usr/bin/python3
"""PyTorch baseline for isthmus training throughput.

The same model as the C++ worker: a GPT-2 decoder (pre-LN, tanh-GELU, tied token
embedding, learned positions) over the byte vocabulary (256), with LoRA adapters on
attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj (A [r, in], B [out, r], B zero at start,
scale alpha / r) and the base frozen, or all parameters trained in --mode full. Trains with
AdamW on random tokens, times --steps steps after --warmup steps and prints one JSON line,
e.g. {"tokens_per_s": 12345.6, "ms_per_step": ..., ...}.

--family llama: the Llama decoder instead, as Hugging Face's LlamaForCausalLM computes it
(RMS norm, rotary positions with rotate_half, grouped-query attention with --kv-heads
key/value heads repeated over the query heads, SwiGLU MLP of width --inner, linears
without biases, an untied lm_head unless --tied), LoRA on all seven linears of the block
(self_attn.q_proj, k_proj, v_proj, o_proj, mlp.gate_proj, up_proj, down_proj), as
bench_train --family llama.

Variants for the GPU comparison: --precision bf16 (autocast around forward and loss, fp32
master weights and AdamW state, as PyTorch AMP does), --attention sdpa
(F.scaled_dot_product_attention instead of the explicit masked softmax) and --compile
(torch.compile; the untimed warmup steps absorb the compilation). sdpa and --compile need
PyTorch 2.0 or later; on older versions the script says so and exits with status 2.

Run with /usr/bin/python3 (the interpreter that sees the system's python3-torch), or with
the python3 that has a CUDA build of torch for --device cuda.
"""

import argparse
import contextlib
import json
import math
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256


def die(msg):
    """One clear line on stderr and status 2; run.sh shows the line as the reason."""
    print("torch_gpt.py: error: " + msg, file=sys.stderr)
    sys.exit(2)


def block_linears(family, width, heads, kv_heads, inner):
    """(fan-in, fan-out) of each linear of a block, in the C++ model's target order."""
    c, i = width, inner
    if family == "gpt2":
        return [(c, 3 * c), (c, c), (c, i), (i, c)]
    kv = kv_heads * (width // heads)
    return [(c, c), (c, kv), (c, kv), (c, c), (c, i), (c, i), (i, c)]


def model_flops_per_token(layers, width, ctx, mode, rank, linears):
    """Model FLOPs per trained token; the C++ bench_train uses the same definition.

    P = L * (block matmul weights: for GPT-2 c_attn 3C^2, attn.c_proj C^2, c_fc 4C^2,
        mlp.c_proj 4C^2 = 12C^2; for Llama q and o C^2 each, k and v C*Ckv each, gate,
        up and down C*I each) + V*C (the head, tied or not). Biases, norms, GELU/SiLU,
        rotary, softmax, the embedding lookups and the optimizer are not counted.
    Attention forward per token = 2*L*C*T: QK^T and PV, 2 flops per multiply-add, over
        the causal half of the T positions (2 products * 2 flops * C * T/2).
    Forward per token F = 2*P + 2*L*C*T.
    full: flops_per_token = 3*F (backward = input gradients + weight gradients = 2*F).
    lora: the frozen base needs the forward and the input-gradient matmuls but no weight
        gradients: flops_per_token = 2*(2*P) + 3*(2*L*C*T) + 6*A, where
        A = r * sum over the adapted linears of (in + out) (GPT-2's four targets: L*r*16*C;
        Llama: all seven linears). The input gradient of
        every base matmul is counted, including the few autograd can skip (layer 0's
        c_attn, whose input needs no gradient), so the figure is a convention shared by
        both implementations rather than a count of what either executes.
    mfu = flops_per_token * tokens_per_s / (peak_tflops * 1e12).
    """
    L, C, T, V = layers, width, ctx, VOCAB
    P = L * sum(i * o for i, o in linears) + V * C
    attn = 2 * L * C * T
    if mode == "full":
        return 3 * (2 * P + attn)
    A = L * rank * sum(i + o for i, o in linears)
    return 2 * (2 * P) + 3 * attn + 6 * A


class LoRALinear(nn.Module):
    """y = x W^T + b + (alpha / r) * x A^T B^T, with W and b frozen in LoRA mode."""

    def __init__(self, n_in, n_out, rank, alpha, lora, bias=True):
        super().__init__()
        self.base = nn.Linear(n_in, n_out, bias=bias)
        nn.init.normal_(self.base.weight, std=0.02)
        if bias:
            nn.init.zeros_(self.base.bias)
        self.rank = rank if lora else 0
        if self.rank > 0:
            for p in self.base.parameters():
                p.requires_grad_(False)
            self.lora_A = nn.Parameter(torch.empty(rank, n_in))
            self.lora_B = nn.Parameter(torch.zeros(n_out, rank))
            # PEFT's default initialisation of A.
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            self.scale = alpha / rank

    def forward(self, x):
        y = self.base(x)
        if self.rank > 0:
            y = y + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale
        return y


class Block(nn.Module):
    def __init__(self, width, heads, rank, alpha, lora, sdpa):
        super().__init__()
        self.heads = heads
        self.sdpa = sdpa
        self.ln_1 = nn.LayerNorm(width, eps=1e-5)
        self.c_attn = LoRALinear(width, 3 * width, rank, alpha, lora)
        self.attn_c_proj = LoRALinear(width, width, rank, alpha, lora)
        self.ln_2 = nn.LayerNorm(width, eps=1e-5)
        self.c_fc = LoRALinear(width, 4 * width, rank, alpha, lora)
        self.mlp_c_proj = LoRALinear(4 * width, width, rank, alpha, lora)

    def forward(self, x, mask):
        b, t, c = x.shape
        h = self.heads
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        if self.sdpa:
            # Scale 1/sqrt(head dim) by default, as below.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # Explicit causal attention (all torch 1.13 has).
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
            att = att.masked_fill(mask[:t, :t], float("-inf")).softmax(dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.attn_c_proj(y)
        x = x + self.mlp_c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return x


class GPT(nn.Module):
    def __init__(self, layers, width, heads, ctx, rank, alpha, lora, sdpa):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, width)
        self.wpe = nn.Embedding(ctx, width)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)  # GPT-2's, and the C++ model's
        self.h = nn.ModuleList(Block(width, heads, rank, alpha, lora, sdpa) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, eps=1e-5)
        self.register_buffer(
            "mask", torch.triu(torch.ones(ctx, ctx, dtype=torch.bool), diagonal=1), persistent=False
        )
        if lora:
            for p in (self.wte.weight, self.wpe.weight):
                p.requires_grad_(False)
            for ln in [self.ln_f] + [m for blk in self.h for m in (blk.ln_1, blk.ln_2)]:
                for p in ln.parameters():
                    p.requires_grad_(False)

    def forward(self, idx, targets):
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.h:
            x = blk(x, self.mask)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied output projection
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class RMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps), as LlamaRMSNorm (torch 1.13 has no nn.RMSNorm)."""

    def __init__(self, width, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, width, heads, kv_heads, inner, eps, rank, alpha, lora, sdpa):
        super().__init__()
        self.heads, self.kv_heads, self.sdpa = heads, kv_heads, sdpa
        d = width // heads

        def linear(n_in, n_out):
            return LoRALinear(n_in, n_out, rank, alpha, lora, bias=False)

        self.input_layernorm = RMSNorm(width, eps)
        self.q_proj = linear(width, heads * d)
        self.k_proj = linear(width, kv_heads * d)
        self.v_proj = linear(width, kv_heads * d)
        self.o_proj = linear(heads * d, width)
        self.post_attention_layernorm = RMSNorm(width, eps)
        self.gate_proj = linear(width, inner)
        self.up_proj = linear(width, inner)
        self.down_proj = linear(inner, width)

    def forward(self, x, mask, cos, sin):
        b, t, c = x.shape
        h, hkv = self.heads, self.kv_heads
        d = c // h
        n = self.input_layernorm(x)
        q = self.q_proj(n).view(b, t, h, d).transpose(1, 2)
        k = self.k_proj(n).view(b, t, hkv, d).transpose(1, 2)
        v = self.v_proj(n).view(b, t, hkv, d).transpose(1, 2)
        cos, sin = cos[:t], sin[:t]  # [T, D], broadcast over [B, heads, T, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if hkv != h:  # Hugging Face's repeat_kv: query head i reads kv head i // (h / hkv)
            k = k[:, :, None].expand(b, hkv, h // hkv, t, d).reshape(b, h, t, d)
            v = v[:, :, None].expand(b, hkv, h // hkv, t, d).reshape(b, h, t, d)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            att = att.masked_fill(mask[:t, :t], float("-inf")).softmax(dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.o_proj(y)
        n = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n))


class Llama(nn.Module):
    def __init__(self, layers, width, heads, kv_heads, inner, ctx, tied, rank, alpha, lora, sdpa,
                 theta=10000.0, eps=1e-5):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, width)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        self.layers = nn.ModuleList(
            LlamaBlock(width, heads, kv_heads, inner, eps, rank, alpha, lora, sdpa) for _ in range(layers))
        self.norm = RMSNorm(width, eps)
        self.lm_head = None
        if not tied:
            self.lm_head = nn.Linear(width, VOCAB, bias=False)
            nn.init.normal_(self.lm_head.weight, std=0.02)
        # Rotary tables as LlamaRotaryEmbedding computes them (no rope scaling).
        d = width // heads
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.arange(ctx, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.register_buffer(
            "mask", torch.triu(torch.ones(ctx, ctx, dtype=torch.bool), diagonal=1), persistent=False
        )
        if lora:
            frozen = [self.embed_tokens, self.norm] + ([self.lm_head] if self.lm_head is not None else [])
            frozen += [m for blk in self.layers for m in (blk.input_layernorm, blk.post_attention_layernorm)]
            for m in frozen:
                for p in m.parameters():
                    p.requires_grad_(False)

    def forward(self, idx, targets):
        x = self.embed_tokens(idx)
        for blk in self.layers:
            x = blk(x, self.mask, self.cos, self.sin)
        head = self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight
        logits = self.norm(x) @ head.t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def check_support(args):
    """Refuse, in one line, what this torch cannot do, instead of failing mid-run."""
    v = torch.__version__
    if args.attention == "sdpa" and not hasattr(F, "scaled_dot_product_attention"):
        die("--attention sdpa needs torch.nn.functional.scaled_dot_product_attention "
            "(PyTorch 2.0 or later); this is torch %s" % v)
    if args.compile and not hasattr(torch, "compile"):
        die("--compile needs torch.compile (PyTorch 2.0 or later); this is torch %s" % v)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            die("--device cuda: torch %s sees no CUDA device (built for CUDA %s, "
                "torch.cuda.is_available() is False)" % (v, torch.version.cuda))
        if args.precision == "bf16" and not torch.cuda.is_bf16_supported():
            die("--precision bf16: %s does not support bfloat16 (torch %s)"
                % (torch.cuda.get_device_name(), v))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=["gpt2", "llama"], default="gpt2")
    ap.add_argument("--kv-heads", type=int, default=0, help="llama: key/value heads (0: --heads)")
    ap.add_argument("--inner", type=int, default=0, help="llama: the MLP's hidden width (0: 4 * --width)")
    ap.add_argument("--tied", action="store_true", help="llama: the head is the token embedding (default: untied)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256, help="sequence length T (and position table size)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step B")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank r")
    ap.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (scale alpha / r)")
    ap.add_argument("--steps", type=int, default=10, help="timed training steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (they absorb --compile)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    ap.add_argument("--mode", choices=["lora", "full"], default="lora")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: autocast around forward and loss; weights and AdamW state stay fp32")
    ap.add_argument("--attention", choices=["manual", "sdpa"], default="manual",
                    help="manual: explicit masked softmax; sdpa: F.scaled_dot_product_attention")
    ap.add_argument("--compile", action="store_true", help="wrap the model with torch.compile")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="peak of the device for mfu (default: H100 SXM dense bf16)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.width % args.heads != 0:
        ap.error("--width must be a multiple of --heads")
    llama = args.family == "llama"
    if not llama and (args.kv_heads or args.inner or args.tied):
        ap.error("--kv-heads, --inner and --tied are for --family llama")
    args.kv_heads = args.kv_heads or args.heads
    args.inner = args.inner or 4 * args.width
    if llama and (args.heads % args.kv_heads != 0 or (args.width // args.heads) % 2 != 0):
        ap.error("--family llama needs --kv-heads dividing --heads and an even head size")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    check_support(args)

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda:
        # peak_mem_bytes: the most PyTorch's allocator held in tensors at once over the whole
        # run, warmup (and compilation) included; the CUDA context and cached free blocks are
        # not counted.
        torch.cuda.reset_peak_memory_stats(dev)

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    lora = args.mode == "lora"
    sdpa = args.attention == "sdpa"
    if llama:
        model = Llama(args.layers, args.width, args.heads, args.kv_heads, args.inner, args.ctx, args.tied,
                      args.rank, args.alpha, lora, sdpa).to(dev)
    else:
        model = GPT(args.layers, args.width, args.heads, args.ctx, args.rank, args.alpha, lora, sdpa).to(dev)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0 if lora else 0.1)
    run_model = torch.compile(model) if args.compile else model

    def autocast():
        if args.precision == "bf16":
            return torch.autocast(device_type=dev.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # Every step's tokens up front, drawn on the CPU from --seed in the same order as before
    # (so the data is the same on every device), kept on the device as bytes: no host RNG or
    # host-to-device copy inside the timed loop.
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    batches = torch.stack([
        torch.randint(0, VOCAB, (args.batch, args.ctx + 1), generator=gen)
        for _ in range(args.warmup + args.steps)
    ]).to(torch.uint8).to(dev)

    def step(i):
        data = batches[i].long()
        with autocast():
            loss = run_model(data[:, :-1], data[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    try:
        for i in range(args.warmup):
            step(i)
        sync()
        t0 = time.perf_counter()
        for i in range(args.warmup, args.warmup + args.steps):
            loss = step(i)
        sync()
        elapsed = time.perf_counter() - t0
        final_loss = float(loss.item())
    except Exception as e:  # a compile or out-of-memory failure: traceback, then one line
        traceback.print_exc()
        die("run failed (torch %s, %s, %s, %s attention%s): %s: %s" % (
            torch.__version__, dev.type, args.precision, args.attention,
            ", compile" if args.compile else "", type(e).__name__,
            (str(e).strip().splitlines() or [""])[0][:200]))

    tokens = args.steps * args.batch * args.ctx
    tokens_per_s = tokens / elapsed
    linears = block_linears(args.family, args.width, args.heads, args.kv_heads, args.inner)
    flops_per_token = model_flops_per_token(args.layers, args.width, args.ctx, args.mode, args.rank, linears)
    mfu = flops_per_token * tokens_per_s / (args.peak_tflops * 1e12)
    print(json.dumps({
        "tokens_per_s": round(tokens_per_s, 1),
        "ms_per_step": round(1000 * elapsed / args.steps, 2),
        "mode": args.mode, "family": args.family,
        "layers": args.layers, "width": args.width, "heads": args.heads, "kv_heads": args.kv_heads,
        "inner": args.inner, "tied": args.tied or not llama, "ctx": args.ctx,
        "batch": args.batch, "rank": args.rank if lora else 0, "alpha": args.alpha if lora else 0,
        "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
        "trainable_params": sum(p.numel() for p in params),
        "total_params": sum(p.numel() for p in model.parameters()),
        "final_loss": round(final_loss, 4),
        "device": str(dev), "torch": torch.__version__,
        "precision": args.precision, "attention": args.attention, "compile": args.compile,
        "peak_mem_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
        "flops_per_token": flops_per_token,
        "mfu": float("%.4g" % mfu), "peak_tflops": args.peak_tflops,
        "gpu": torch.cuda.get_device_name(dev) if cuda else None,
        # "highest": fp32 matmuls stay fp32 (PyTorch's default); "high": TF32 tensor cores.
        "fp32_matmul_precision": torch.get_float32_matmul_precision() if cuda else None,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
