#!/usr/bin/python3
"""PyTorch baseline for isthmus training throughput.

The same model as the C++ worker: a GPT-2 decoder (pre-LN, tanh-GELU, tied token
embedding, learned positions) over the byte vocabulary (256), with LoRA adapters on
attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj (A [r, in], B [out, r], B zero at start,
scale alpha / r) and the base frozen, or all parameters trained in --mode full. Trains with
AdamW on random tokens, times --steps steps after --warmup steps and prints one JSON line,
e.g. {"tokens_per_s": 12345.6, "ms_per_step": ..., ...}.

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


def model_flops_per_token(layers, width, ctx, mode, rank):
    """Model FLOPs per trained token; the C++ bench_train uses the same definition.

    P = L*12*C^2 (block matmul weights: c_attn 3C^2, attn.c_proj C^2, c_fc 4C^2,
        mlp.c_proj 4C^2) + V*C (tied head). Biases, LayerNorm, GELU, softmax, the
        embedding lookups and the optimizer are not counted.
    Attention forward per token = 2*L*C*T: QK^T and PV, 2 flops per multiply-add, over
        the causal half of the T positions (2 products * 2 flops * C * T/2).
    Forward per token F = 2*P + 2*L*C*T.
    full: flops_per_token = 3*F (backward = input gradients + weight gradients = 2*F).
    lora: the frozen base needs the forward and the input-gradient matmuls but no weight
        gradients: flops_per_token = 2*(2*P) + 3*(2*L*C*T) + 6*A, where
        A = r * sum over the adapted linears of (in + out) = L*r*16*C for the four targets
        (c_attn C+3C, attn.c_proj C+C, c_fc C+4C, mlp.c_proj 4C+C). The input gradient of
        every base matmul is counted, including the few autograd can skip (layer 0's
        c_attn, whose input needs no gradient), so the figure is a convention shared by
        both implementations rather than a count of what either executes.
    mfu = flops_per_token * tokens_per_s / (peak_tflops * 1e12).
    """
    L, C, T, V = layers, width, ctx, VOCAB
    P = L * 12 * C * C + V * C
    attn = 2 * L * C * T
    if mode == "full":
        return 3 * (2 * P + attn)
    A = L * rank * 16 * C
    return 2 * (2 * P) + 3 * attn + 6 * A


class LoRALinear(nn.Module):
    """y = x W^T + b + (alpha / r) * x A^T B^T, with W and b frozen in LoRA mode."""

    def __init__(self, n_in, n_out, rank, alpha, lora):
        super().__init__()
        self.base = nn.Linear(n_in, n_out)
        nn.init.normal_(self.base.weight, std=0.02)
        nn.init.zeros_(self.base.bias)
        self.rank = rank if lora else 0
        if self.rank > 0:
            self.base.weight.requires_grad_(False)
            self.base.bias.requires_grad_(False)
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
    model = GPT(args.layers, args.width, args.heads, args.ctx, args.rank, args.alpha, lora,
                args.attention == "sdpa").to(dev)
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
    flops_per_token = model_flops_per_token(args.layers, args.width, args.ctx, args.mode, args.rank)
    mfu = flops_per_token * tokens_per_s / (args.peak_tflops * 1e12)
    print(json.dumps({
        "tokens_per_s": round(tokens_per_s, 1),
        "ms_per_step": round(1000 * elapsed / args.steps, 2),
        "mode": args.mode,
        "layers": args.layers, "width": args.width, "heads": args.heads, "ctx": args.ctx,
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
