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
window, targets -1 (no loss) outside the translation, as isthmus-worker reads it. With
`teacher_topk` (the cache `isthmus-worker teach` writes beside the shard) each batch also
carries the teacher's top-k ids and logits per position, and `loss(..., teacher=...)` is the
word-level distillation loss alpha * CE + (1 - alpha) * T^2 * KL(teacher_T || student_T) that
isthmus-worker train --teacher-topk uses (distill_loss).
"""

import hashlib
import json
import math
import os
import struct

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

    def loss(self, idx, targets, teacher=None, alpha=0.5, temperature=2.0):
        """Mean cross-entropy over the positions whose target is not -1; with `teacher`
        (the (ids, logits) a token_batches with teacher_topk yields) the distillation loss
        (distill_loss) over the same positions."""
        logits = self(idx)
        if teacher is not None:
            return distill_loss(logits, targets, teacher[0], teacher[1], alpha, temperature)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-1)

    @torch.no_grad()
    def translate(self, text, language, max_tokens=200):
        """The student's translation of English `text` into `language`, as isthmus-worker
        generate --translate makes it: the prompt "en: <text>\n<language>: " of
        isthmus-data parallel's task, then the most likely byte each step (the window
        sliding over the last n_ctx tokens) until the continuation holds the blank line
        that ends a translation, or max_tokens; returns the text before that line (bytes
        that are not UTF-8 replaced). Byte-level models only (vocabulary 256)."""
        vocab, n_ctx = self.base["wte.weight"].shape[0], self.base["wpe.weight"].shape[0]
        if vocab != 256:
            raise ValueError(f"translate reads bytes, but this model has {vocab} ids: use "
                             "isthmus-worker generate --translate with its tokenizer")
        ids = list(f"en: {text}\n{language}: ".encode())
        start = len(ids)
        for _ in range(max_tokens):
            window = torch.tensor([ids[-n_ctx:]])
            ids.append(int(self(window)[0, -1].argmax()))
            if b"\n\n" in bytes(ids[start:]):
                break
        out = bytes(ids[start:])
        return out.split(b"\n\n")[0].decode("utf-8", errors="replace")


def distill_loss(logits, targets, teacher_ids, teacher_logits, alpha=0.5, temperature=2.0):
    """Word-level distillation (Hinton et al. 2015), as isthmus-worker computes it
    (ops::DistillCrossEntropy): the mean over the positions whose target is not -1 of
    alpha * CE(target) + (1 - alpha) * T^2 * KL(p || q), where p is the softmax of the
    teacher's k logits / T (its top-k, renormalised) and q the student's softmax over the
    whole vocabulary / T, read at the teacher's ids. logits [..., V]; targets [...];
    teacher_ids and teacher_logits [..., k]."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if not temperature > 0.0:
        raise ValueError(f"the temperature must be positive, got {temperature}")
    v, k = logits.shape[-1], teacher_ids.shape[-1]
    keep = targets.reshape(-1) >= 0
    z = logits.reshape(-1, v)[keep]
    ce = F.cross_entropy(z, targets.reshape(-1)[keep], reduction="none")
    log_q = F.log_softmax(z / temperature, dim=-1).gather(
        1, teacher_ids.reshape(-1, k)[keep].long())
    log_p = F.log_softmax(teacher_logits.reshape(-1, k)[keep].to(z.dtype) / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    return (alpha * ce + (1.0 - alpha) * temperature * temperature * kl).mean()


class _TeacherTopK:
    """The cache `isthmus-worker teach` writes (worker/data/teacher_cache.h): a teacher's k
    largest logits at every learned position of a task shard. Opening it checks that it
    was computed on this very shard (the SHA-256 of its tokens and loss mask) and, when
    `vocab_size` is given, for that vocabulary: ValueError otherwise, never a silent reuse."""

    def __init__(self, path, shard_path, tokens, mask, context, vocab_size=None):
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) < 12 or head[:8] != b"ISTHTOPK":
                raise ValueError(f"{path}: not a teacher cache (isthmus-worker teach writes them)")
            (n,) = struct.unpack("<I", head[8:])
            info = json.loads(f.read(n))
        self.k, self.info = int(info["k"]), info
        if vocab_size is not None and info["vocab_size"] != vocab_size:
            raise ValueError(f"{path}: the teacher's vocabulary ({info['vocab_size']} ids, "
                             f"tokenizer {info['tokenizer']}) is not the student's "
                             f"({vocab_size} ids)")
        if info["example_tokens"] != context:
            raise ValueError(f"{path}: computed on examples of {info['example_tokens']} tokens, "
                             f"not {context}")
        digest = hashlib.sha256()
        with open(shard_path, "rb") as f:
            digest.update(f.read())
        digest.update(mask.tobytes())
        if digest.hexdigest() != info["shard_digest"]:
            raise ValueError(f"{path}: computed on another shard than {shard_path}: run "
                             "isthmus-worker teach again for this shard")
        windows = (len(tokens) - 1) // context
        learned = mask[1:windows * context + 1].reshape(windows, context) != 0
        self.offsets = np.concatenate([[0], np.cumsum(learned.sum(axis=1))])
        record = np.dtype([("ids", "<i4", (self.k,)), ("logits", "<f4", (self.k,))])
        self.records = np.memmap(path, dtype=record, mode="r", offset=12 + n)
        if len(self.records) != info["positions"] or self.offsets[-1] != info["positions"]:
            raise ValueError(f"{path}: {len(self.records)} records for a shard with "
                             f"{self.offsets[-1]} learned positions (cut short?)")

    def rows(self, windows, y):
        """ids and logits [B, T, k] for the windows `windows` whose targets are `y` [B, T]
        (zero where the target is -1)."""
        b, t = y.shape
        ids = np.zeros((b, t, self.k), dtype=np.int64)
        logits = np.zeros((b, t, self.k), dtype=np.float32)
        for r, w in enumerate(windows):
            learned = y[r] >= 0
            part = self.records[self.offsets[w]:self.offsets[w + 1]]
            ids[r, learned] = part["ids"]
            logits[r, learned] = part["logits"]
        return torch.from_numpy(ids), torch.from_numpy(logits)


def token_batches(path, batch, context, seed, teacher_topk=None, vocab_size=None):
    """Endless random (tokens, targets) batches of `context` tokens from a shard written by
    isthmus-data (train.bin or val.bin; the manifest beside it gives the token width). A
    task shard with a loss mask (isthmus-data parallel) gives whole examples, one per
    window of its example length, which `context` must equal, with target -1 wherever the
    mask says the token is not learned (the prompt and the padding). With `teacher_topk`
    (a task shard's cache from isthmus-worker teach, checked to be this shard's)
    the batches are (tokens, targets, (teacher_ids, teacher_logits)) for Gpt2Lora.loss."""
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
    teacher = None
    if teacher_topk is not None:
        if mask is None:
            raise ValueError(f"{path}: distillation needs a task shard with a loss mask "
                             "(isthmus-data parallel)")
        teacher = _TeacherTopK(teacher_topk, path, tokens, mask, context, vocab_size)
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
        if teacher is not None:
            yield torch.from_numpy(x), torch.from_numpy(y), teacher.rows(starts // context, y)
        else:
            yield torch.from_numpy(x), torch.from_numpy(y)
