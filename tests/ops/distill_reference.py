"""A from-scratch PyTorch reference of the word-level distillation loss (tests/ops/ops_test.cc,
DistillLossTest.MatchesAFromScratchPyTorchKl): reads the inputs the test wrote as raw
little-endian arrays, computes alpha * CE + (1 - alpha) * T^2 * KL(p_T || q_T) per row in
float64 with the softmaxes written out (no torch.nn.functional), takes the gradient of the
mean over the rows with a target by autograd, and writes losses and gradient back.
Usage: distill_reference.py DIR N V K ALPHA TEMPERATURE"""

import sys

import numpy as np
import torch

folder, n, v, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
alpha, temp = float(sys.argv[5]), float(sys.argv[6])


def read(name, dtype, shape):
    return torch.from_numpy(np.fromfile(f"{folder}/{name}", dtype=dtype).reshape(shape).copy())


logits = read("logits", "<f4", (n, v)).double().requires_grad_(True)
targets = read("targets", "<i4", (n,)).long()
ids = read("ids", "<i4", (n, k)).long()
teacher = read("teacher", "<f4", (n, k)).double()


def log_softmax(x):
    m = x.max(dim=-1, keepdim=True).values
    return x - m - torch.log(torch.exp(x - m).sum(dim=-1, keepdim=True))


losses = []
for i in range(n):
    if targets[i] < 0:
        losses.append(torch.zeros((), dtype=torch.float64))
        continue
    ce = -log_softmax(logits[i])[targets[i]]
    log_q = log_softmax(logits[i] / temp)[ids[i]]
    log_p = log_softmax(teacher[i] / temp)
    kl = (torch.exp(log_p) * (log_p - log_q)).sum()
    losses.append(alpha * ce + (1 - alpha) * temp * temp * kl)
losses = torch.stack(losses)
counted = int((targets >= 0).sum())
(losses.sum() / counted).backward()
losses.detach().float().numpy().astype("<f4").tofile(f"{folder}/losses")
logits.grad.float().numpy().astype("<f4").tofile(f"{folder}/grad")
