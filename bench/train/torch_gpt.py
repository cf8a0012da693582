#!/usr/bin/python3
"""PyTorch baseline for isthmus training throughput.

The same model as the C++ worker: a GPT-2 decoder (pre-LN, tanh-GELU, tied token
embedding, learned positions) over the byte vocabulary (256), with LoRA adapters on
attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj (A [r, in], B [out, r], B zero at start,
scale alpha / r) and the base frozen, or all parameters trained in --mode full. Trains with
AdamW on random tokens, times --steps steps after --warmup steps and prints one JSON line,
e.g. {"tokens_per_s": 12345.6, "ms_per_step": ..., ...}.

Run with /usr/bin/python3 (the interpreter that sees the system's python3-torch).
"""

import argparse
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256


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
    def __init__(self, width, heads, rank, alpha, lora):
        super().__init__()
        self.heads = heads
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
        # Explicit causal attention: torch 1.13 has no scaled_dot_product_attention.
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
        att = att.masked_fill(mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.attn_c_proj(y)
        x = x + self.mlp_c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return x


class GPT(nn.Module):
    def __init__(self, layers, width, heads, ctx, rank, alpha, lora):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, width)
        self.wpe = nn.Embedding(ctx, width)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)
        self.h = nn.ModuleList(Block(width, heads, rank, alpha, lora) for _ in range(layers))
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
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    ap.add_argument("--mode", choices=["lora", "full"], default="lora")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.width % args.heads != 0:
        ap.error("--width must be a multiple of --heads")

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    lora = args.mode == "lora"
    model = GPT(args.layers, args.width, args.heads, args.ctx, args.rank, args.alpha, lora).to(dev)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0 if lora else 0.1)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)

    def step():
        data = torch.randint(0, VOCAB, (args.batch, args.ctx + 1), generator=gen).to(dev)
        loss = model(data[:, :-1], data[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    for _ in range(args.warmup):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    final_loss = float(loss.item())  # .item() waits for the device
    elapsed = time.perf_counter() - t0

    tokens = args.steps * args.batch * args.ctx
    print(json.dumps({
        "tokens_per_s": round(tokens / elapsed, 1),
        "ms_per_step": round(1000 * elapsed / args.steps, 2),
        "mode": args.mode,
        "layers": args.layers, "width": args.width, "heads": args.heads, "ctx": args.ctx,
        "batch": args.batch, "rank": args.rank if lora else 0, "alpha": args.alpha if lora else 0,
        "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
        "trainable_params": sum(p.numel() for p in params),
        "total_params": sum(p.numel() for p in model.parameters()),
        "final_loss": round(final_loss, 4),
        "device": str(dev), "torch": torch.__version__,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
