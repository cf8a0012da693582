"""isthmus.llama: isthmus-worker's Llama-family model in PyTorch, so a PyTorch site can train
the same LoRA job as isthmus-worker sites on a Hugging Face folder (`--base DIR`).

The model is the Hugging Face decoder of model_type llama, qwen2 or mistral as isthmus-worker
computes it (worker/model/gpt.cc; the float64 reference is tests/model/llama_reference.py):
RMSNorm, rotary positions in Hugging Face's rotate_half layout (inv_freq = theta^(-2i/D)
rounded to fp32, with Llama 3's rope_scaling), grouped-query attention (query head h reads
kv head h // (H / Hkv)), a SwiGLU MLP, Qwen2's q/k/v biases, a tied or untied head. The base
stays frozen (requires_grad False); the LoRA factors are the trainable parameters, named as
the job's tensors on the shards:

    layers.{l}.self_attn.{q,k,v,o}_proj.lora_A.weight   [r, in]
    layers.{l}.mlp.{gate,up,down}_proj.lora_B.weight     [out, r]   (and so on)

and an adapted linear computes y = x W^T + b + (alpha / r) (x A^T) B^T:

    model = isthmus.llama.LlamaLora.from_folder("Llama-3.2-1B", lora=site.pull(), alpha=32.0)
    rank = isthmus.torch.SiteRank(site, model.job_parameters(), base_hash=model.base_hash())

A config.json isthmus-worker would refuse is refused here too, with a ValueError naming the
field, so a PyTorch site never trains a model the other sites compute differently.
"""

import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from . import read_safetensors, tensors_hash

__all__ = ["LlamaLora", "TARGETS", "read_config", "read_checkpoint"]

# Every linear LoRA can adapt, in isthmus-worker's order (its default: all of them).
TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_FAMILIES = ("llama", "qwen2", "mistral")


def read_config(path):
    """config.json of a Hugging Face folder as isthmus-worker reads it (ParseHfConfig): a dict
    of the shape and options, or ValueError naming the field it cannot compute."""
    with open(path) as f:
        try:
            j = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(j, dict):
        raise ValueError(f"{path} is not a JSON object")

    def refuse(field, why):
        return ValueError(f"{path}: {field} {why}")

    def given(field):
        return j.get(field) is not None

    def integer(field, fallback=None):
        if not given(field):
            if fallback is None:
                raise refuse(field, "is missing")
            return fallback
        v = j[field]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 1 << 30:
            raise refuse(field, f"must be a positive integer, got {json.dumps(v)}")
        return v

    def number(field, fallback):
        if not given(field):
            return fallback
        v = j[field]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise refuse(field, f"must be a number, got {json.dumps(v)}")
        return float(v)

    def flag(field, fallback):
        v = j.get(field)
        return v if isinstance(v, bool) else fallback

    family = j.get("model_type", "")
    if family not in _FAMILIES:
        raise refuse("model_type", f"{json.dumps(family)} is not one isthmus.llama computes "
                     f"({', '.join(_FAMILIES)}; GPT-2: isthmus.gpt2)")
    c = {"family": family,
         "layers": integer("num_hidden_layers"),
         "hidden": integer("hidden_size"),
         "heads": integer("num_attention_heads")}
    c["kv_heads"] = integer("num_key_value_heads", c["heads"])
    c["intermediate"] = integer("intermediate_size")
    c["context"] = integer("max_position_embeddings")
    c["vocab"] = integer("vocab_size")
    c["theta"] = number("rope_theta", 10000.0)
    c["eps"] = number("rms_norm_eps", 1e-6)
    c["tied"] = flag("tie_word_embeddings", family == "qwen2")
    c["qkv_bias"] = family == "qwen2" or flag("attention_bias", False)
    act = j.get("hidden_act", "silu")
    if act != "silu":
        raise refuse("hidden_act", f"{json.dumps(act)} is not silu")
    if (c["hidden"] % c["heads"] == 0 and given("head_dim")
            and j["head_dim"] != c["hidden"] // c["heads"]):
        raise refuse("head_dim", f"{json.dumps(j['head_dim'])} differs from hidden_size / "
                     f"num_attention_heads ({c['hidden'] // c['heads']}), which isthmus needs")
    if family == "llama" and flag("attention_bias", False):
        raise refuse("attention_bias", "true (biases on o_proj) is not supported")
    if flag("mlp_bias", False):
        raise refuse("mlp_bias", "true is not supported")
    for moe in ("num_local_experts", "num_experts", "num_experts_per_tok"):
        if given(moe):
            raise refuse(moe, "is set: mixtures of experts are not supported")
    if "quantization_config" in j:
        raise refuse("quantization_config", "is set: quantized checkpoints are not supported")
    window = j.get("sliding_window")
    if ((family == "mistral" or flag("use_sliding_window", False))
            and isinstance(window, int) and not isinstance(window, bool)
            and window < c["context"]):
        raise refuse("sliding_window", f"{window} is shorter than the context: sliding-window "
                     "attention is not supported")
    c["rope_scaling"] = None
    r = j.get("rope_scaling")
    if r is not None:
        rope_type = r.get("rope_type", r.get("type", "")) if isinstance(r, dict) else ""
        if rope_type not in ("llama3", "default"):
            raise refuse("rope_scaling", f"{json.dumps(r)} is not supported (only rope_type "
                         "llama3)")
        if rope_type == "llama3":
            scaling = {}
            for name in ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"):
                v = r.get(name)
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise refuse(f"rope_scaling.{name}", "is missing or not a number")
                scaling[name] = float(v)
            scaling["original_max_position_embeddings"] = int(
                scaling["original_max_position_embeddings"])
            if not (scaling["factor"] >= 1 and 0 < scaling["low_freq_factor"]
                    < scaling["high_freq_factor"]
                    and scaling["original_max_position_embeddings"] > 0):
                raise refuse("rope_scaling", "needs factor >= 1, 0 < low_freq_factor < "
                             "high_freq_factor and original_max_position_embeddings > 0")
            c["rope_scaling"] = scaling
    if c["hidden"] % c["heads"]:
        raise refuse("num_attention_heads", f"{c['heads']} does not divide hidden_size "
                     f"{c['hidden']}")
    if c["heads"] % c["kv_heads"]:
        raise refuse("num_key_value_heads", f"{c['kv_heads']} does not divide "
                     f"num_attention_heads {c['heads']}")
    if (c["hidden"] // c["heads"]) % 2:
        raise refuse("hidden_size", f"gives the head size {c['hidden'] // c['heads']}, which "
                     "must be even for rotary positions")
    if not (math.isfinite(c["theta"]) and c["theta"] > 0):
        raise refuse("rope_theta", "must be positive")
    if not (math.isfinite(c["eps"]) and c["eps"] > 0):
        raise refuse("rms_norm_eps", "must be positive")
    return c


def read_checkpoint(folder):
    """{name: float32 array} of a Hugging Face folder's model.safetensors, or of the shards
    its model.safetensors.index.json lists (each tensor in the shard the index names)."""
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return read_safetensors(single)[0]
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.exists(index):
        raise FileNotFoundError(f"{folder}: no model.safetensors and no "
                                "model.safetensors.index.json (a Hugging Face model folder "
                                "holds one of them)")
    with open(index) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: not an index (a weight_map of tensor name -> shard file)")
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        if not isinstance(shard, str) or "/" in shard or shard in ("", ".", ".."):
            raise ValueError(f"{index}: {shard!r} is not a file name in the index's folder")
        part, _ = read_safetensors(os.path.join(folder, shard))
        listed = {n for n, s in weight_map.items() if s == shard}
        if set(part) != listed:
            raise ValueError(f"{index}: {shard} holds {sorted(set(part) ^ listed)[:3]} "
                             "other than the index says")
        tensors.update(part)
    return tensors


def _rope_inv_freq(head_size, theta, scaling=None):
    """The D/2 rotary frequencies, as isthmus-worker computes them (Gpt::RopeTable): theta^
    (-2i/D) in float64 rounded to fp32, then, for rope_type llama3, transformers'
    _compute_llama3_parameters in float64 on those, rounded to fp32 again."""
    inv = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    inv = inv.float().double()
    if scaling:
        factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - low) / (high - low)
        inv = torch.where(wavelen > orig / low, inv / factor,
                          torch.where(wavelen < orig / high, inv,
                                      (1 - smooth) * inv / factor + smooth * inv))
    return inv.float()


class _Linear(torch.nn.Module):
    """A frozen Hugging Face linear (weight [out, in], optional bias), with LoRA when adapted."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.lora_A = self.lora_B = None
        self.scale = 0.0

    def adapt(self, a, b, scale):
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(b)
        self.scale = scale

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if self.lora_A is not None:
            y = y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale
        return y


class _RMSNorm(torch.nn.Module):
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension; weight frozen."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + self.eps))


class LlamaLora(torch.nn.Module):
    """A Llama-family model with LoRA, float32. Build it with from_folder(); forward(idx)
    gives the logits [B, T, V] of tokens idx [B, T] (T at most max_position_embeddings)."""

    def __init__(self, config, tensors):
        """config: read_config()'s dict; tensors: {Hugging Face name: float32 array} of the
        checkpoint. Adapts nothing: from_folder() adds the LoRA factors."""
        super().__init__()
        c = self.config = config
        self.head_size = c["hidden"] // c["heads"]
        kv = c["kv_heads"] * self.head_size
        shapes = {"model.embed_tokens.weight": (c["vocab"], c["hidden"]),
                  "model.norm.weight": (c["hidden"],)}
        if not c["tied"]:
            shapes["lm_head.weight"] = (c["vocab"], c["hidden"])
        for l in range(c["layers"]):
            p = f"model.layers.{l}."
            shapes[p + "input_layernorm.weight"] = (c["hidden"],)
            shapes[p + "post_attention_layernorm.weight"] = (c["hidden"],)
            for name, rows in (("q_proj", c["hidden"]), ("k_proj", kv), ("v_proj", kv)):
                shapes[p + f"self_attn.{name}.weight"] = (rows, c["hidden"])
                if c["qkv_bias"]:
                    shapes[p + f"self_attn.{name}.bias"] = (rows,)
            shapes[p + "self_attn.o_proj.weight"] = (c["hidden"], c["hidden"])
            shapes[p + "mlp.gate_proj.weight"] = (c["intermediate"], c["hidden"])
            shapes[p + "mlp.up_proj.weight"] = (c["intermediate"], c["hidden"])
            shapes[p + "mlp.down_proj.weight"] = (c["hidden"], c["intermediate"])
        for name, t in tensors.items():
            if name in shapes:
                continue
            tied_head = (name == "lm_head.weight" and c["tied"]
                         and tuple(t.shape) == shapes["model.embed_tokens.weight"])
            if not (tied_head or name.endswith("rotary_emb.inv_freq")):
                raise ValueError(f"unknown tensor {name!r} {list(t.shape)} for a "
                                 f"{c['family']} of this shape")

        def take(name):
            if name not in tensors:
                raise ValueError(f"the checkpoint lacks tensor {name!r}")
            if tuple(tensors[name].shape) != shapes[name]:
                raise ValueError(f"tensor {name!r} has shape {list(tensors[name].shape)}, the "
                                 f"config.json gives {list(shapes[name])}")
            return torch.tensor(np.asarray(tensors[name], dtype=np.float32))

        def frozen(name):
            return torch.nn.Parameter(take(name), requires_grad=False)

        def linear(name, bias=False):
            return _Linear(take(name + ".weight"), take(name + ".bias") if bias else None)

        self.embed_tokens = frozen("model.embed_tokens.weight")
        self.layers = torch.nn.ModuleList()
        for l in range(c["layers"]):
            p = f"model.layers.{l}."
            layer = torch.nn.Module()
            layer.input_layernorm = _RMSNorm(take(p + "input_layernorm.weight"), c["eps"])
            layer.post_attention_layernorm = _RMSNorm(take(p + "post_attention_layernorm.weight"),
                                                      c["eps"])
            layer.self_attn = torch.nn.Module()
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(layer.self_attn, name, linear(p + "self_attn." + name, c["qkv_bias"]))
            layer.self_attn.o_proj = linear(p + "self_attn.o_proj")
            layer.mlp = torch.nn.Module()
            for name in ("gate_proj", "up_proj", "down_proj"):
                setattr(layer.mlp, name, linear(p + "mlp." + name))
            self.layers.append(layer)
        self.norm = _RMSNorm(take("model.norm.weight"), c["eps"])
        self.lm_head = None if c["tied"] else frozen("lm_head.weight")
        # cos and sin [n_ctx, D] in fp32: the angle t * inv_freq[i] rounded to fp32 first.
        inv = _rope_inv_freq(self.head_size, c["theta"], c["rope_scaling"])
        angle = torch.arange(c["context"], dtype=torch.float32)[:, None] * inv[None, :]
        angle = torch.cat((angle, angle), dim=-1)
        self.register_buffer("rope_cos", angle.cos(), persistent=False)
        self.register_buffer("rope_sin", angle.sin(), persistent=False)
        self._names = {}  # job tensor name -> (linear, "lora_A" | "lora_B")
        self.rank = self.alpha = None

    @classmethod
    def from_folder(cls, path, lora=None, rank=None, alpha=32.0, targets=None, seed=0):
        """The model of a Hugging Face folder (config.json and model.safetensors or the
        sharded index), LoRA on `targets` (TARGETS, or short names such as "q_proj"; None:
        all seven) with scale alpha / rank.

        lora: {job tensor name: array} (site.pull(), or read_safetensors of isthmus-worker
        init --out or --save) loaded into the factors; their rank and targets are the
        tensors', and a `rank` or `targets` given must agree. None: new factors of `rank`
        (None: 16), A ~ uniform(-1/sqrt(in), 1/sqrt(in)) and B = 0 (PEFT's initialisation,
        from torch.Generator().manual_seed(seed); not isthmus-worker's values)."""
        config = read_config(os.path.join(path, "config.json"))
        model = cls(config, read_checkpoint(path))
        model._add_lora(lora, rank, alpha, targets, seed)
        return model

    def _add_lora(self, lora, rank, alpha, targets, seed):
        if targets is not None:
            if isinstance(targets, str):
                targets = targets.split(",")
            full = {t.split(".")[-1]: t for t in TARGETS}
            unknown = [t for t in targets if t not in TARGETS and t not in full]
            if unknown or not targets:
                raise ValueError(f"unknown LoRA targets {unknown} (allowed: {', '.join(TARGETS)}"
                                 " or their last part)")
            targets = [full.get(t, t) for t in targets]
            if len(set(targets)) != len(targets):
                raise ValueError(f"duplicate LoRA targets in {targets}")
        if lora is not None:
            found = sorted({n.split(".", 2)[2].rsplit(".", 2)[0] for n in lora
                            if n.count(".") >= 4 and n.startswith("layers.")},
                           key=lambda t: TARGETS.index(t) if t in TARGETS else len(TARGETS))
            if targets is not None and set(targets) != set(found):
                raise ValueError(f"the LoRA tensors adapt {found}, not targets={targets}")
            if not found or any(t not in TARGETS for t in found):
                raise ValueError(f"the LoRA tensors {sorted(lora)[:3]} are not named as a "
                                 "Llama job's (layers.N.self_attn.q_proj.lora_A.weight, ...)")
            targets = found
            ranks = {np.shape(a)[0] for n, a in lora.items() if n.endswith(".lora_A.weight")}
            if len(ranks) != 1:
                raise ValueError(f"the LoRA tensors have ranks {sorted(ranks)}: need one")
            [found_rank] = ranks
            if rank is not None and rank != found_rank:
                raise ValueError(f"the LoRA tensors have rank {found_rank}, not rank={rank}")
            rank = found_rank
        targets = list(TARGETS) if targets is None else targets
        rank = 16 if rank is None else rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise ValueError(f"rank must be a positive integer, got {rank!r}")
        if not math.isfinite(alpha):
            raise ValueError(f"alpha must be finite, got {alpha}")
        self.rank, self.alpha = rank, float(alpha)
        g = torch.Generator().manual_seed(seed)
        left = set(lora or ())
        for l, layer in enumerate(self.layers):
            for target in targets:
                module, name = target.split(".")
                lin = getattr(getattr(layer, module), name)
                out_features, in_features = lin.weight.shape
                a_name = f"layers.{l}.{target}.lora_A.weight"
                b_name = f"layers.{l}.{target}.lora_B.weight"
                if lora is None:
                    bound = 1.0 / math.sqrt(in_features)
                    a = (torch.rand(rank, in_features, generator=g) * 2 - 1) * bound
                    b = torch.zeros(out_features, rank)
                else:
                    a, b = (self._factor(lora, n, shape) for n, shape in
                            ((a_name, (rank, in_features)), (b_name, (out_features, rank))))
                    left -= {a_name, b_name}
                lin.adapt(a, b, self.alpha / rank)
                self._names[a_name] = (lin, "lora_A")
                self._names[b_name] = (lin, "lora_B")
        if left:
            raise ValueError(f"tensors {sorted(left)[:3]} are not LoRA factors of this model "
                             f"({len(self.layers)} layers, targets {targets})")

    @staticmethod
    def _factor(lora, name, shape):
        if name not in lora:
            raise ValueError(f"the LoRA tensors lack {name!r}")
        a = np.asarray(lora[name], dtype=np.float32)
        if a.shape != shape:
            raise ValueError(f"LoRA tensor {name!r} has shape {list(a.shape)}, this model "
                             f"needs {list(shape)}")
        return torch.tensor(a)

    def job_parameters(self):
        """{job tensor name: parameter} of the LoRA factors: what SiteRank pushes and pulls."""
        return {n: getattr(lin, which) for n, (lin, which) in self._names.items()}

    def base_hash(self):
        """The job's base hash: isthmus.tensors_hash of the checkpoint's tensors under their
        Hugging Face names and shapes (without a tied head or rotary buffers), as
        isthmus-worker init --base DIR prints it."""
        tensors = {"model.embed_tokens.weight": self.embed_tokens,
                   "model.norm.weight": self.norm.weight}
        if self.lm_head is not None:
            tensors["lm_head.weight"] = self.lm_head
        for l, layer in enumerate(self.layers):
            for name, p in layer.named_parameters():
                if ".lora_" not in "." + name:
                    tensors[f"model.layers.{l}.{name}"] = p
        return tensors_hash({n: p.detach().cpu().contiguous().numpy()
                             for n, p in tensors.items()})

    def forward(self, idx):
        c = self.config
        B, T = idx.shape
        if T > c["context"]:
            raise ValueError(f"{T} tokens are more than max_position_embeddings "
                             f"({c['context']})")
        H, Hkv, D = c["heads"], c["kv_heads"], self.head_size
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]

        def rope(t):
            rotated = torch.cat((-t[..., D // 2:], t[..., :D // 2]), dim=-1)
            return t * cos + rotated * sin

        mask = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
        x = self.embed_tokens[idx]
        for layer in self.layers:
            n = layer.input_layernorm(x)
            att = layer.self_attn
            q = rope(att.q_proj(n).view(B, T, H, D).transpose(1, 2))
            k = rope(att.k_proj(n).view(B, T, Hkv, D).transpose(1, 2))
            v = att.v_proj(n).view(B, T, Hkv, D).transpose(1, 2)
            if H != Hkv:
                k = k.repeat_interleave(H // Hkv, dim=1)
                v = v.repeat_interleave(H // Hkv, dim=1)
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
            p = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            x = x + att.o_proj((p @ v).transpose(1, 2).reshape(B, T, H * D))
            n = layer.post_attention_layernorm(x)
            mlp = layer.mlp
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(n)) * mlp.up_proj(n))
        x = self.norm(x)
        return F.linear(x, self.embed_tokens if self.lm_head is None else self.lm_head)

    def loss(self, idx, targets):
        """Mean cross-entropy over the positions whose target is not -1."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-1)
