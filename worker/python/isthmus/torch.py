"""isthmus.torch: turn a PyTorch training loop into a rank of an isthmus site.

    site = isthmus.Site(servers, job="gpt", key=..., server_keys=[...])
    rank = isthmus.torch.SiteRank(site, model.named_parameters(), steps_per_round=50)
    rank.start()                        # hello, pull the merged values into the model
    for batch in data:
        loss = model(batch).backward(); optimizer.step(); optimizer.zero_grad()
        rank.step(tokens=batch.numel())  # every H steps: push, wait, pull (a round)
    rank.finish()                       # pushes a partial last round, if any

The round is the one isthmus-worker runs (worker/round_loop.cc): the trainable values are
remembered when a round starts; after H optimizer steps the change since then is pushed
to the site's shards as round r+1 (with the site's tokens and compute time), the site
waits while it is more than max_rounds_ahead rounds past the last cross-site commit, and
the merged values are pulled back into the parameters (the optimizer's state is kept).

Pass only the parameters the job holds, under the job's names (for a PEFT model, e.g.
`{n: p for n, p in model.named_parameters() if p.requires_grad}`, renamed if needed).

Several ranks of one site: call torch.distributed.init_process_group first and average
gradients as usual (DDP); every rank runs SiteRank the same way. Rank 0 pulls and
broadcasts; rank r pushes the shards s with s % world == r, as isthmus-worker does.
"""

import time

import torch

from . import _shard_error

__all__ = ["SiteRank"]


class SiteRank:
    """One rank of a site (see the module's docs).

    site: an isthmus.Site of this site's shards.
    parameters: (name, tensor) pairs or a {name: tensor} dict: the job's trainable tensors.
    steps_per_round: H, the optimizer steps between pushes.
    base_hash: the base model's hash the job was created with ("" = not checked).
    process_group: the torch.distributed group of the site's ranks (None: the default
        group when torch.distributed is initialized, else a site of one rank).
    staleness_timeout_s: how long a round may wait for the WAN before RuntimeError.
    """

    def __init__(self, site, parameters, steps_per_round=50, base_hash="", process_group=None,
                 staleness_timeout_s=3600.0):
        if steps_per_round < 1:
            raise ValueError("steps_per_round must be at least 1")
        items = parameters.items() if hasattr(parameters, "items") else parameters
        self.params = {}
        for name, p in items:
            if name in self.params:
                raise ValueError(f"parameter '{name}' is given twice")
            if p.dtype != torch.float32:
                raise TypeError(f"parameter '{name}' is {p.dtype}; isthmus jobs hold float32 "
                                f"tensors (keep fp32 master weights)")
            self.params[name] = p
        if not self.params:
            raise ValueError("no parameters given")
        self.site = site
        self.steps_per_round = int(steps_per_round)
        self.base_hash = base_hash
        self.group = process_group
        self.staleness_timeout_s = float(staleness_timeout_s)
        dist = torch.distributed
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self._dist else 0
        self.world = dist.get_world_size(process_group) if self._dist else 1
        self.round = 0            # the last round pushed (or found on the shards at start)
        self.steps_in_round = 0
        self._tokens = 0
        self._start = None        # values at the round's start, CPU fp32
        self._round_t0 = None
        self._compute_s = 0.0

    # -- the round protocol ------------------------------------------------------------

    def start(self):
        """Hello to every shard, pull the merged values into the parameters and start a
        round. Returns the round the site continues from (the shards' local round)."""
        hellos = self.site.hello(self.base_hash)
        self.round = max(h["local_round"] for h in hellos)
        # Every rank learns where each tensor lives; rank 0's values are the ones used.
        self._pull_and_share(every_rank=True)
        return self.round

    def step(self, tokens=0):
        """Call after each optimizer step; `tokens`: tokens this rank trained on in it.
        Ends the round (push, wait, pull) every steps_per_round steps; returns True then."""
        if self._start is None:
            raise RuntimeError("call start() before step()")
        now = time.perf_counter()
        if self._round_t0 is not None:
            self._compute_s += now - self._round_t0
        self._tokens += int(tokens)
        self.steps_in_round += 1
        ended = False
        if self.steps_in_round >= self.steps_per_round:
            self.end_round()
            ended = True
        self._round_t0 = time.perf_counter()
        return ended

    def end_round(self):
        """Pushes the change since the round started as round self.round + 1, waits while
        the site is too far ahead, and pulls the merged values into the parameters."""
        if self._start is None:
            raise RuntimeError("call start() before end_round()")
        tokens = torch.tensor([self._tokens], dtype=torch.float64)
        if self._dist and self.world > 1:
            torch.distributed.all_reduce(tokens, group=self.group)
        deltas = {}
        with torch.no_grad():
            for name, p in self.params.items():
                deltas[name] = (p.detach().to("cpu", torch.float32) - self._start[name]).contiguous()
        self.round += 1
        self.site.push_round(self.round, deltas, tokens=int(tokens.item()),
                             compute_ms=int(self._compute_s * 1e3 + 0.5), rank=self.rank,
                             world=self.world)
        self._barrier()
        self._wait_for_wan()
        self._pull_and_share(every_rank=False)

    def finish(self):
        """Ends a partial round (steps taken since the last push), if there is one."""
        if self._start is not None and self.steps_in_round > 0:
            self.end_round()

    # -- helpers -------------------------------------------------------------------------

    def _barrier(self):
        if self._dist and self.world > 1:
            torch.distributed.barrier(group=self.group)

    def _wait_for_wan(self):
        ok = torch.ones(1)
        reason = ""
        if self.rank == 0:
            st = self.site.wait_within_staleness(timeout_s=self.staleness_timeout_s)
            if st["too_far_ahead"]:
                ok.zero_()
                reason = st["reason"]
        if self._dist and self.world > 1:
            torch.distributed.broadcast(ok, src=self._src(), group=self.group)
        if ok.item() == 0:
            raise RuntimeError(f"round {self.round}: the WAN did not catch up in "
                               f"{self.staleness_timeout_s:.0f} s ({reason or 'rank 0 timed out'})")

    def _src(self):
        # Global rank of the group's rank 0 (what broadcast's src means).
        if self.group is None:
            return 0
        return torch.distributed.get_global_rank(self.group, 0)

    def _pull_and_share(self, every_rank):
        if self.rank == 0 or every_rank:
            merged = self.site.pull()
            if self.rank == 0:
                missing = [n for n in self.params if n not in merged]
                if missing:
                    raise _shard_error(
                        "NotFound", f"job '{self.site.job}' holds no tensor named "
                        f"{', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
                with torch.no_grad():
                    for name, p in self.params.items():
                        src = torch.from_numpy(merged[name])
                        if tuple(src.shape) != tuple(p.shape):
                            raise _shard_error(
                                "FailedPrecondition", f"tensor '{name}' is {tuple(src.shape)} "
                                f"on the shards but {tuple(p.shape)} here")
                        p.copy_(src)
        if self._dist and self.world > 1:
            with torch.no_grad():
                for p in self.params.values():
                    torch.distributed.broadcast(p.data, src=self._src(), group=self.group)
        self._start = {n: p.detach().to("cpu", torch.float32).clone()
                       for n, p in self.params.items()}
        self.steps_in_round = 0
        self._tokens = 0
        self._compute_s = 0.0
        self._round_t0 = time.perf_counter()
