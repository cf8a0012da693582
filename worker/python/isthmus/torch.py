"""isthmus.torch: turn a PyTorch training loop into a rank of an isthmus site.

    site = isthmus.Site(servers, job="gpt", key=..., server_keys=[...])
    rank = isthmus.torch.SiteRank(site, model.named_parameters(), steps_per_round=80)
    rank.start()                        # hello, pull the merged values into the model
    for batch in data:
        loss = model(batch).backward(); optimizer.step(); optimizer.zero_grad()
        rank.step(tokens=batch.numel())  # every H steps: the end of a round
    rank.finish()                       # pushes a partial last round, if any

The round is the one isthmus-worker runs (worker/round_loop.cc), through the same round
driver (common/round_driver.h, Site.start_round / wait_round): the trainable values are
remembered when a round starts; after H optimizer steps the change since then is pushed to
the site's shards as round r+1 (with the site's tokens and compute time), the site waits
while it is more than max_rounds_ahead rounds past the last cross-site commit, and the
merged values are pulled back into the parameters (the optimizer's state is kept).

With overlap=True the push, the wait and the pull run in the background while the next
round trains, and the pulled values are merged at a step boundary with the local progress
made meanwhile kept: params := params + (pulled - base), base := pulled (docs/SYNC.md,
"The overlapped round"); the next round's change is then exactly the steps trained since
the round began. Counting the round in flight the rank stays within max_rounds_ahead
rounds of the last commit.

Pass only the parameters the job holds, under the job's names (for a PEFT model, e.g.
`{n: p for n, p in model.named_parameters() if p.requires_grad}`, renamed if needed).

Several ranks of one site: call torch.distributed.init_process_group first and average
gradients as usual (DDP); every rank runs SiteRank the same way. Rank 0 pulls and
broadcasts; rank r pushes the shards s with s % world == r, as isthmus-worker does. With
overlap every rank agrees after each step, in one small all-reduce while a round is in
flight, whether to merge it now.
"""

import time

import torch

from . import ShardError, _shard_error

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
    overlap: end rounds in the background while the next round trains (default True).
    merge_after_steps: with overlap, merge the round in flight no earlier than this many
        steps into the next round, then as soon as it is done (None, the default: a tenth
        of steps_per_round, at least 1; 0: as soon as it is done).
    merge_wait: merge at exactly the merge_after_steps step, waiting for the round there
        if need be, so training never depends on when the WAN delivers.
    """

    def __init__(self, site, parameters, steps_per_round=80, base_hash="", process_group=None,
                 staleness_timeout_s=3600.0, overlap=True, merge_after_steps=None,
                 merge_wait=False):
        if steps_per_round < 1:
            raise ValueError("steps_per_round must be at least 1")
        if merge_after_steps is None:
            merge_after_steps = max(1, int(steps_per_round) // 10)
        if merge_after_steps < 0:
            raise ValueError("merge_after_steps must be >= 0 (0: merge on arrival; None: a "
                             "tenth of the round)")
        if merge_wait and merge_after_steps == 0:
            raise ValueError("merge_wait needs a merge step: merge_after_steps > 0 or None")
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
        self.overlap = bool(overlap)
        self.merge_after_steps = int(merge_after_steps)
        self.merge_wait = bool(merge_wait)
        dist = torch.distributed
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if self._dist else 0
        self.world = dist.get_world_size(process_group) if self._dist else 1
        self.round = 0            # the last round pushed (or found on the shards at start)
        self.steps_in_round = 0
        self._tokens = 0
        self._base = None         # the round's base, CPU fp32 (the values its delta is from)
        self._limit = 0           # max_rounds_ahead as the shards said
        self._inflight = False    # a round started with start_round, not yet merged
        self._progressed = False  # a step since the base was taken
        self._round_t0 = None
        self._compute_s = 0.0

    # -- the round protocol ------------------------------------------------------------

    def start(self):
        """Hello to every shard, pull the merged values into the parameters and start a
        round. Returns the round the site continues from (the shards' local round)."""
        hellos = self.site.hello(self.base_hash)
        self.round = max(h["local_round"] for h in hellos)
        self._limit = min(h["max_rounds_ahead"] for h in hellos)
        # Every rank learns where each tensor lives; rank 0's values are the ones used.
        self._load(self._pull_checked(), progressed=False)
        self._new_round()
        return self.round

    def step(self, tokens=0):
        """Call after each optimizer step; `tokens`: tokens this rank trained on in it.
        Ends the round every steps_per_round steps (returns True then); with overlap, merges
        the round in flight once it is done and merge_after_steps steps have passed (with
        merge_wait: at that step, waiting for it there)."""
        if self._base is None:
            raise RuntimeError("call start() before step()")
        now = time.perf_counter()
        if self._round_t0 is not None:
            self._compute_s += now - self._round_t0
        self._tokens += int(tokens)
        self.steps_in_round += 1
        self._progressed = True
        if self._inflight and self._merge_now():
            self._complete()
        ended = False
        if self.steps_in_round >= self.steps_per_round:
            self.end_round()
            ended = True
        self._round_t0 = time.perf_counter()
        return ended

    def end_round(self):
        """Pushes the change since the round started as round self.round + 1; without
        overlap also waits while the site is too far ahead and pulls the merged values
        into the parameters (with overlap that happens in the background)."""
        if self._base is None:
            raise RuntimeError("call start() before end_round()")
        if self._inflight:
            self._complete()
        tokens = torch.tensor([self._tokens], dtype=torch.float64)
        if self._multi():
            torch.distributed.all_reduce(tokens, group=self.group)
        deltas = {}
        with torch.no_grad():
            for name, p in self.params.items():
                live = p.detach().to("cpu", torch.float32)
                d = (live - self._base[name]).contiguous()
                # live := base + delta, the value a shard adding the delta to base holds.
                now = self._base[name] + d
                p.copy_(now)
                self._base[name] = now
                deltas[name] = d
        self.round += 1
        self.site.start_round(self.round, deltas, tokens=int(tokens.item()),
                              compute_ms=int(self._compute_s * 1e3 + 0.5), rank=self.rank,
                              world=self.world, pull=self.rank == 0, overlap=self.overlap,
                              wait_timeout_s=self.staleness_timeout_s)
        self._inflight = True
        self._progressed = False
        self._new_round()
        if not self.overlap:
            self._complete()
        elif self._limit == 0:
            # The round in flight must commit before the next one trains.
            if self.rank == 0:
                self.site.await_round_bound()

    def finish(self):
        """Ends a partial round (steps taken since the last push), if there is one, and
        waits for the round in flight."""
        if self._base is not None and self.steps_in_round > 0:
            self.end_round()
        if self._inflight:
            self._complete()

    # -- helpers -------------------------------------------------------------------------

    def _multi(self):
        return self._dist and self.world > 1

    def _new_round(self):
        self.steps_in_round = 0
        self._tokens = 0
        self._compute_s = 0.0
        self._round_t0 = time.perf_counter()

    def _merge_now(self):
        """Whether every rank merges the round in flight after this step (as
        common/round_driver.h's MergePolicy decides for isthmus-worker)."""
        at = self.merge_after_steps
        if self.merge_wait:
            return self.steps_in_round == at
        return self.steps_in_round >= at and self._agree_done()

    def _agree_done(self):
        """True on every rank when rank 0's round in flight is done, or any rank's failed."""
        state = self.site.round_state()
        flags = torch.tensor([1.0 if self.rank == 0 and state in ("done", "failed") else 0.0,
                              1.0 if state == "failed" else 0.0])
        if self._multi():
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX,
                                         group=self.group)
        if flags[1].item() > 0 and self.rank == 0:
            self.site.cancel_round()
        return flags.sum().item() > 0

    def _complete(self):
        """Waits for the round in flight, shares the outcome with every rank and merges the
        pulled values into the parameters."""
        error, out = None, None
        try:
            out = self.site.wait_round()
        except ShardError as e:
            error = e
        self._inflight = False
        failed = torch.tensor([1.0 if error is not None else 0.0])
        if self._multi():
            torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX,
                                         group=self.group)
        if error is not None:
            if error.code == "Timeout" and "did not catch up" in error.message:
                raise RuntimeError(f"round {self.round}: {error.message}") from error
            raise error
        if failed.item() > 0:
            raise RuntimeError(f"round {self.round}: another rank of the site could not finish "
                               f"it (see that rank's error)")
        self._limit = out["limit"]
        self._load(out["pulled"] if self.rank == 0 else None, progressed=self._progressed)

    def _pull_checked(self):
        merged = self.site.pull()
        if self.rank == 0:
            missing = [n for n in self.params if n not in merged]
            if missing:
                raise _shard_error(
                    "NotFound", f"job '{self.site.job}' holds no tensor named "
                    f"{', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
        return merged

    def _src(self):
        # Global rank of the group's rank 0 (what broadcast's src means).
        if self.group is None:
            return 0
        return torch.distributed.get_global_rank(self.group, 0)

    def _load(self, pulled, progressed):
        """Rank 0's pulled values P (every rank receives them) become the base; the
        parameters become P (nothing trained since the base was taken) or params + (P -
        base) (the local progress kept)."""
        with torch.no_grad():
            new_base = {}
            for name, p in self.params.items():
                if self.rank == 0:
                    if name not in pulled:
                        raise _shard_error("NotFound", f"job '{self.site.job}' holds no tensor "
                                           f"named {name}")
                    src = torch.from_numpy(pulled[name]).to(torch.float32)
                    if tuple(src.shape) != tuple(p.shape):
                        raise _shard_error(
                            "FailedPrecondition", f"tensor '{name}' is {tuple(src.shape)} "
                            f"on the shards but {tuple(p.shape)} here")
                    src = src.to(p.device, copy=True)
                else:
                    src = torch.empty(p.shape, dtype=torch.float32, device=p.device)
                if self._multi():
                    torch.distributed.broadcast(src, src=self._src(), group=self.group)
                if progressed and self._base is not None:
                    p.add_(src - self._base[name].to(p.device))
                else:
                    p.copy_(src)
                new_base[name] = src.to("cpu", copy=True)
            self._base = new_base
