"""A from-scratch PyTorch reference of the Hugging Face Llama-family decoder (Llama 2/3, Qwen2,
Mistral without sliding window; eager attention, no dropout), for the C++ model test: writes a
random checkpoint in Hugging Face layout (OUT/hf/config.json, OUT/hf/model.safetensors), a batch
(OUT/tokens.i32, OUT/targets.i32: B*T little-endian int32, target -1 = ignored), optionally a PEFT
LoRA adapter (OUT/adapter.safetensors and OUT/adapter_config.json, lora_alpha = 2 r, so
y = x W^T + b + 2 (x A^T) B^T), and OUT/expected.safetensors holding "loss" [1] and the
gradient of the mean cross-entropy over the kept positions for every trained tensor (the adapter's
tensors in LoRA mode, every base tensor otherwise), under the tensor's own name. The forward pass
is written out with torch ops in float64 (no transformers, no safetensors module).
Usage: llama_reference.py OUT --family llama|qwen2|mistral [--tied] [--rope-scaling]
       [--lora-rank R --lora-targets q_proj,v_proj,...] [--seed S] [--vocab V] [--hidden C]
       [--layers L] [--heads H] [--kv-heads HKV] [--intermediate I] [--ctx N] [--batch B]
       [--seq T] [--eps E] [--theta THETA]"""

import argparse
import json
import math
import os
import struct

import torch

ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
EPS = {"llama": 1e-6, "qwen2": 1e-6, "mistral": 1e-5}
THETA = {"llama": 10000.0, "qwen2": 1000000.0, "mistral": 10000.0}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def write_safetensors(path, tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--family", required=True, choices=sorted(ARCH))
    p.add_argument("--tied", action="store_true")
    p.add_argument("--rope-scaling", action="store_true")
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--lora-targets", default="")
    p.add_argument("--seed", type=int, default=0)
    for flag, default in (("vocab", 61), ("hidden", 32), ("layers", 2), ("heads", 4), ("kv-heads", 2),
                          ("intermediate", 40), ("ctx", 16), ("batch", 2), ("seq", 7)):
        p.add_argument("--" + flag, type=int, default=default)
    p.add_argument("--eps", type=float, default=None)
    p.add_argument("--theta", type=float, default=None)
    a = p.parse_args()
    a.eps = EPS[a.family] if a.eps is None else a.eps
    a.theta = THETA[a.family] if a.theta is None else a.theta
    if a.rope_scaling and a.family != "llama":
        p.error("--rope-scaling is for --family llama only")
    if a.lora_rank and not a.lora_targets:
        p.error("--lora-rank needs --lora-targets")
    if a.hidden % a.heads or a.heads % a.kv_heads or (a.hidden // a.heads) % 2:
        p.error("need hidden % heads == 0, heads % kv_heads == 0 and an even head size")
    return a


def config_json(a):
    cfg = {"architectures": [ARCH[a.family]], "model_type": a.family, "hidden_size": a.hidden,
           "intermediate_size": a.intermediate, "num_hidden_layers": a.layers,
           "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads,
           "max_position_embeddings": a.ctx, "rms_norm_eps": a.eps, "rope_theta": a.theta,
           "vocab_size": a.vocab, "tie_word_embeddings": a.tied, "hidden_act": "silu",
           "torch_dtype": "float32"}
    if a.family == "llama":
        cfg["attention_bias"] = False
        cfg["rope_scaling"] = None
        if a.rope_scaling:
            cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    if a.family == "mistral":
        cfg["sliding_window"] = None
    return cfg


def init_weights(a, g):
    c, d = a.hidden, a.hidden // a.heads
    normal = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    w = {"model.embed_tokens.weight": 0.2 * normal(a.vocab, c)}
    for l in range(a.layers):
        pre = f"model.layers.{l}."
        w[pre + "input_layernorm.weight"] = 1 + 0.1 * normal(c)
        for name, rows in (("q_proj", a.heads * d), ("k_proj", a.kv_heads * d), ("v_proj", a.kv_heads * d)):
            w[pre + f"self_attn.{name}.weight"] = 0.2 * normal(rows, c)
            if a.family == "qwen2":
                w[pre + f"self_attn.{name}.bias"] = 0.1 * normal(rows)
        w[pre + "self_attn.o_proj.weight"] = 0.2 * normal(c, a.heads * d)
        w[pre + "post_attention_layernorm.weight"] = 1 + 0.1 * normal(c)
        w[pre + "mlp.gate_proj.weight"] = 0.2 * normal(a.intermediate, c)
        w[pre + "mlp.up_proj.weight"] = 0.2 * normal(a.intermediate, c)
        w[pre + "mlp.down_proj.weight"] = 0.2 * normal(c, a.intermediate)
    w["model.norm.weight"] = 1 + 0.1 * normal(c)
    if not a.tied:
        w["lm_head.weight"] = 0.2 * normal(a.vocab, c)
    # rounded to float32 so the gradients are exactly those of the checkpoint as written
    return {name: t.float().double() for name, t in w.items()}


def inv_freq(a):
    d = a.hidden // a.heads
    inv = a.theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    if not a.rope_scaling:
        return inv
    factor, low, high, orig = 8.0, 1.0, 4.0, 8.0   # transformers' _compute_llama3_parameters
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = orig / low, orig / high
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen > low_wavelen, inv / factor,
                       torch.where(wavelen < high_wavelen, inv, smoothed))


def forward_logits(a, w, lora, tokens):
    """Logits [B*T, V] of tokens [B, T]."""
    b, t = tokens.shape
    h, hkv, d = a.heads, a.kv_heads, a.hidden // a.heads
    scale = 2.0 if a.lora_rank else 0.0   # lora_alpha / r with lora_alpha = 2 r

    def linear(x, name):
        y = x @ w[name + ".weight"].T
        if name + ".bias" in w:
            y = y + w[name + ".bias"]
        if "base_model.model." + name + ".lora_A.weight" in lora:
            la = lora["base_model.model." + name + ".lora_A.weight"]
            lb = lora["base_model.model." + name + ".lora_B.weight"]
            y = y + scale * ((x @ la.T) @ lb.T)
        return y

    def rmsnorm(x, weight):
        return weight * (x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + a.eps))

    def rotate_half(x):
        return torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1)

    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq(a)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = torch.cos(emb), torch.sin(emb)          # [T, D], broadcast over [B, heads, T, D]
    causal = torch.ones(t, t, dtype=torch.bool).tril()

    x = w["model.embed_tokens.weight"][tokens]
    for l in range(a.layers):
        pre = f"model.layers.{l}."
        n = rmsnorm(x, w[pre + "input_layernorm.weight"])
        q = linear(n, pre + "self_attn.q_proj").view(b, t, h, d).transpose(1, 2)
        k = linear(n, pre + "self_attn.k_proj").view(b, t, hkv, d).transpose(1, 2)
        v = linear(n, pre + "self_attn.v_proj").view(b, t, hkv, d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(h // hkv, dim=1)       # head i uses kv head i // (h / hkv)
        v = v.repeat_interleave(h // hkv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(~causal, float("-inf"))
        scores = scores - scores.max(dim=-1, keepdim=True).values
        p = torch.exp(scores)
        p = p / p.sum(dim=-1, keepdim=True)
        attn = (p @ v).transpose(1, 2).reshape(b, t, h * d)
        x = x + linear(attn, pre + "self_attn.o_proj")
        n = rmsnorm(x, w[pre + "post_attention_layernorm.weight"])
        gate = linear(n, pre + "mlp.gate_proj")
        act = gate / (1 + torch.exp(-gate))              # silu
        x = x + linear(act * linear(n, pre + "mlp.up_proj"), pre + "mlp.down_proj")
    x = rmsnorm(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if a.tied else w["lm_head.weight"]
    return (x @ head.T).reshape(b * t, -1)


def forward_loss(a, w, lora, tokens, targets):
    """Mean cross-entropy over the targets >= 0."""
    logits = forward_logits(a, w, lora, tokens)
    m = logits.max(dim=-1, keepdim=True).values
    log_probs = logits - m - torch.log(torch.exp(logits - m).sum(dim=-1, keepdim=True))
    flat = targets.reshape(-1)
    kept = flat >= 0
    return -log_probs[kept, flat[kept]].sum() / kept.sum()


def make_lora(a, w, g):
    lora = {}
    for l in range(a.layers):
        for target in a.lora_targets.split(","):
            if target not in ATTN + MLP:
                raise SystemExit(f"unknown LoRA target {target}")
            name = f"model.layers.{l}.{'self_attn' if target in ATTN else 'mlp'}.{target}"
            out_features, in_features = w[name + ".weight"].shape
            normal = lambda *shape: (0.2 * torch.randn(*shape, generator=g, dtype=torch.float64)).float().double()
            lora[f"base_model.model.{name}.lora_A.weight"] = normal(a.lora_rank, in_features)
            lora[f"base_model.model.{name}.lora_B.weight"] = normal(out_features, a.lora_rank)
    return lora


def main():
    a = parse_args()
    g = torch.Generator().manual_seed(a.seed)
    w = init_weights(a, g)
    lora = make_lora(a, w, g) if a.lora_rank else {}
    seq = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    tokens, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    drop = torch.rand(a.batch, a.seq, generator=g) < 0.25
    drop.view(-1)[torch.randint(0, a.batch * a.seq, (1,), generator=g)] = False   # keep at least one
    targets[drop] = -1

    trained = lora if a.lora_rank else w
    for t in trained.values():
        t.requires_grad_(True)
    loss = forward_loss(a, w, lora, tokens, targets)
    loss.backward()

    os.makedirs(os.path.join(a.out, "hf"), exist_ok=True)
    with open(os.path.join(a.out, "hf", "config.json"), "w") as f:
        json.dump(config_json(a), f, indent=2)
    write_safetensors(os.path.join(a.out, "hf", "model.safetensors"), w, {"format": "pt"})
    tokens.numpy().astype("<i4").tofile(os.path.join(a.out, "tokens.i32"))
    targets.numpy().astype("<i4").tofile(os.path.join(a.out, "targets.i32"))
    if a.lora_rank:
        write_safetensors(os.path.join(a.out, "adapter.safetensors"), lora, {"format": "pt"})
        with open(os.path.join(a.out, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": a.lora_rank, "lora_alpha": 2 * a.lora_rank,
                       "target_modules": a.lora_targets.split(","), "bias": "none",
                       "task_type": "CAUSAL_LM"}, f, indent=2)
    expected = {"loss": loss.detach().reshape(1)}
    expected.update({name: t.grad for name, t in trained.items()})
    write_safetensors(os.path.join(a.out, "expected.safetensors"), expected, {"format": "pt"})
    print(f"family={a.family} tied={a.tied} rope_scaling={a.rope_scaling} lora_rank={a.lora_rank} "
          f"kept={int((targets >= 0).sum())}/{a.batch * a.seq} loss={loss.item():.9f}")


if __name__ == "__main__":
    main()
