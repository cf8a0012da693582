"""isthmus.gpt2: isthmus-worker's model in PyTorch, so a PyTorch site can train the same
LoRA job as isthmus-worker sites (and read its files).

The model is GPT-2 over isthmus's tensor names and layouts (worker/model/gpt.cc): pre-LN
blocks, tanh-GELU, learned positions, the head tied to wte, layer norm eps 1e-5, Conv1D
weights [in, out]; LoRA on the adapted linears with lora_A [r, in] and lora_B [out, r],
scale alpha / r. The base stays frozen; the LoRA tensors are the parameters:

    base, _ = isthmus.read_safetensors("base.safetensors")
    lora, _ = isthmus.read_safetensors("init.safetensors")   # isthmus-worker init --out
    model = isthmus.gpt2.Gpt2Lora(base, lora, heads=4, alpha=32.0)
    rank = isthmus.torch.SiteRank(site, model.job_parameters(), ...)

token_batches() reads the token shards isthmus-data writes (uint16, or uint32 when the
manifest says so), and the translation task of `isthmus-data parallel`: one example per
window, targets -1 (no loss) outside the translation, as isthmus-worker reads it.
"""

import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class Gpt2Lora(torch.nn.Module):
    def __init__(self, base, lora, heads, alpha):
        """base: {name: array} of the base file (or of a full-mode model); lora: {name:
        array} of the job's LoRA tensors ({} for a plain GPT-2)."""
        super().__init__()
        self.base = {n: torch.tensor(np.asarray(a, dtype=np.float32)) for n, a in base.items()}
        self.heads = heads
        self.layers = 1 + max(int(n.split(".")[1]) for n in base if n.startswith("h."))
        self.lora = torch.nn.ParameterDict()
        self.names = {}  # isthmus name -> ParameterDict key (no dots allowed there)
        rank = None
        for n, a in sorted(lora.items()):
            key = n.replace(".", "_")
            self.lora[key] = torch.nn.Parameter(torch.tensor(np.asarray(a, dtype=np.float32)))
            self.names[n] = key
            if n.endswith("lora_A.weight"):
                rank = a.shape[0]
        self.scale = alpha / rank if rank else 0.0  # no LoRA tensors: a plain GPT-2

    def job_parameters(self):
        """{isthmus tensor name: parameter}: what SiteRank pushes and pulls."""
        return {n: self.lora[k] for n, k in self.names.items()}

    def _linear(self, x, layer, target):
        p = f"h.{layer}.{target}"
        y = x @ self.base[p + ".weight"] + self.base[p + ".bias"]
        a = self.names.get(p + ".lora_A.weight")
        if a is not None:
            b = self.names[p + ".lora_B.weight"]
            y = y + (x @ self.lora[a].t() @ self.lora[b].t()) * self.scale
        return y

    def _ln(self, x, name):
        return F.layer_norm(x, x.shape[-1:], self.base[name + ".weight"],
                            self.base[name + ".bias"], eps=1e-5)

    def forward(self, idx):
        B, T = idx.shape
        wte = self.base["wte.weight"]
        x = wte[idx] + self.base["wpe.weight"][:T]
        C = x.shape[-1]
        hd = C // self.heads
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        for l in range(self.layers):
            a = self._ln(x, f"h.{l}.ln_1")
            q, k, v = self._linear(a, l, "attn.c_attn").split(C, dim=-1)
            q, k, v = (t.view(B, T, self.heads, hd).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, C)
            x = x + self._linear(y, l, "attn.c_proj")
            m = self._ln(x, f"h.{l}.ln_2")
            h = F.gelu(self._linear(m, l, "mlp.c_fc"), approximate="tanh")
            x = x + self._linear(h, l, "mlp.c_proj")
        x = self._ln(x, "ln_f")
        return x @ wte.t()

    def loss(self, idx, targets):
        """Mean cross-entropy over the positions whose target is not -1."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-1)


def token_batches(path, batch, context, seed):
    """Endless random (tokens, targets) batches of `context` tokens from a shard written by
    isthmus-data (train.bin or val.bin; the manifest beside it gives the token width). A
    task shard with a loss mask (isthmus-data parallel) gives whole examples, one per
    window of its example length, which `context` must equal, with target -1 wherever the
    mask says the token is not learned (the prompt and the padding)."""
    manifest = {}
    manifest_path = os.path.join(os.path.dirname(path) or ".", "manifest.json")
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
    dtype = "<u4" if manifest.get("token_dtype") == "uint32-le" else "<u2"
    tokens = np.fromfile(path, dtype=dtype).astype(np.int64)
    mask = None
    if "loss_mask" in manifest:
        part = next((p for p in ("train", "val")
                     if manifest.get(p, {}).get("file") == os.path.basename(path)), None)
        if part is None or part not in manifest["loss_mask"]:
            raise ValueError(f"{manifest_path} names loss masks but none for {path}")
        if manifest.get("example_tokens") != context:
            raise ValueError(f"{path}: its examples are {manifest.get('example_tokens')} tokens "
                             f"each, not {context}: use context={manifest.get('example_tokens')}")
        mask_path = os.path.join(os.path.dirname(path), manifest["loss_mask"][part]["file"])
        mask = np.fromfile(mask_path, dtype=np.uint8)
        if len(mask) != len(tokens):
            raise ValueError(f"{mask_path}: {len(mask)} mask bytes for {len(tokens)} tokens")
    rng = np.random.default_rng(seed)
    while True:
        if mask is None:
            starts = rng.integers(0, len(tokens) - context - 1, size=batch)
        else:
            starts = rng.integers(0, (len(tokens) - 1) // context, size=batch) * context
        x = np.stack([tokens[s:s + context] for s in starts])
        y = np.stack([tokens[s + 1:s + context + 1] for s in starts])
        if mask is not None:
            learned = np.stack([mask[s + 1:s + context + 1] for s in starts]) != 0
            y = np.where(learned, y, -1)
        yield torch.from_numpy(x), torch.from_numpy(y)
