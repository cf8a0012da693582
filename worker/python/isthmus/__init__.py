"""isthmus: take part in an isthmus job from Python.

A *site* is one cluster; its parameter-server shards hold the job's tensors and exchange
the site's round deltas with the other sites over the WAN. A worker rank of a site, in
any framework, does this every round:

    site = isthmus.Site(["tcp://10.0.0.5:7000", "tcp://10.0.0.6:7000"], job="gpt",
                        key="keys/worker.key", server_keys=["keys/shard.pub"])
    site.hello(base_hash)          # refused if the job is held for another base model
    merged = site.pull()           # {name: numpy.float32 array}, read in place
    ... train H steps from `merged` ...
    site.push_round(r, {name: new - merged[name]}, tokens=..., compute_ms=...)
    site.wait_within_staleness()   # bounded staleness: waits while the site is too far
                                   # ahead of the last cross-site commit

isthmus.torch.SiteRank does all of that around a PyTorch training loop. The C++ core is
the same site client isthmus-worker uses (common/site_client.h), so both kinds of worker
speak one protocol. See docs/PYTHON.md.

Files: read_safetensors(path) -> ({name: float32 array}, metadata) (F16/BF16 widened),
write_safetensors(path, tensors, metadata={}) (atomic, F32), and tensors_hash(tensors):
the content hash isthmus uses as a job's base hash (isthmus-worker init prints the same
for its base).

Errors: a refusal or failure of a shard raises ShardError (.code, e.g. "NotFound" or
"InvalidArgument", and .message naming the shard); a delta that is not float32 or not
contiguous, or a bad argument (a round below 1, negative tokens), raises TypeError or
ValueError before anything is sent. A shard that cannot be reached raises ShardError
"Unavailable" within (1 + retries) x connect_timeout_ms (15 s with the defaults). Calls
wait without holding the GIL and stop for Ctrl-C: KeyboardInterrupt arrives within about
0.1 s.
"""

import numbers

from . import _isthmus
from ._isthmus import (  # noqa: F401  (re-exported)
    SCHEMA_VERSION,
    ShardError,
    __version__,
    generate_keypair,
    load_keypair,
    load_public_key,
    read_safetensors,
    tensors_hash,
    write_keypair,
    write_safetensors,
)

__all__ = [
    "Site",
    "ShardError",
    "generate_keypair",
    "load_keypair",
    "load_public_key",
    "write_keypair",
    "read_safetensors",
    "write_safetensors",
    "tensors_hash",
    "SCHEMA_VERSION",
    "__version__",
]


def _shard_error(code, message):
    """A ShardError raised from Python, shaped like the ones the C++ core raises."""
    err = ShardError(f"{code}: {message}")
    err.code = code
    err.message = message
    return err


def _count(name, value, least=0, hint=""):
    """`value` as an int >= least (a float only when whole), or TypeError / ValueError
    naming the argument."""
    whole_float = isinstance(value, numbers.Real) and float(value).is_integer()
    if isinstance(value, bool) or not (isinstance(value, numbers.Integral) or whole_float):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}" + (f" ({hint})" if hint else ""))
    return value


def _as_float32_buffer(name, value):
    """Returns an object the C++ core can read in place: a numpy array stays as it is; a
    torch tensor must be on the CPU, float32 and contiguous, and crosses via .numpy()
    (no copy). Anything else is passed on and refused there if it has no float32 buffer."""
    module = type(value).__module__
    if module.startswith("torch"):
        if value.device.type != "cpu":
            raise ValueError(
                f"delta '{name}' is on {value.device}; isthmus sends CPU memory: pass "
                f"x.detach().cpu()")
        if str(value.dtype) != "torch.float32":
            raise TypeError(
                f"delta '{name}' has dtype {value.dtype}; isthmus takes float32: pass x.float()")
        if not value.is_contiguous():
            raise ValueError(
                f"delta '{name}' is not contiguous: pass x.contiguous()")
        return value.detach().numpy()
    return value


def _round_args(round, deltas, tokens, compute_ms, rank, world):
    """push_round's and start_round's arguments checked and converted, in the core's order
    (round, deltas, tokens, compute_ms, rank, world); ValueError before anything is sent."""
    round = _count("round", round, 1, "rounds count from 1: push the round after the "
                   "shards' local_round (site.hello()[i]['local_round'])")
    tokens = _count("tokens", tokens)
    compute_ms = _count("compute_ms", compute_ms)
    world = _count("world", world, 1)
    rank = _count("rank", rank)
    if rank >= world:
        raise ValueError(f"rank must be below world ({world}), got {rank}")
    converted = {str(n): _as_float32_buffer(n, v) for n, v in deltas.items()}
    return round, converted, tokens, compute_ms, rank, world

class Site:
    """The shards of one site, seen as one (C++: isthmus::SiteClient).

    servers: the shards' worker endpoints, in the order the job was created with.
    job: the job's name.
    key: this rank's key pair file (written by `isthmusctl keygen` or write_keypair; its
        public key must be on the shards' worker allowlist).
    server_keys: public key files of the shards: one for all, or one per server.
    insecure_plaintext: no CURVE (benchmarks and local debugging only; key and
        server_keys are then ignored).
    timeout_ms: per request attempt, how long a connected shard has to answer.
    connect_timeout_ms: per attempt, how long the connection to a shard may take; a shard
        that is down fails the call with ShardError "Unavailable" after
        (1 + retries) x connect_timeout_ms.
    retries: extra attempts after a timeout or a lost connection (a retried push keeps its
        idempotency key, so it is applied at most once).
    client_name: part of every idempotency key, "<job>/<client_name>/r<round>/s<shard>";
        ranks of one site share it (they push different shards).
    pull_by_replay: the pulls of start_round's rounds get the rounds committed since the
        last as the sites' encoded deltas and replay them here, checked against the shard's
        digest, instead of every tensor (isthmus-worker --pull-by-replay; docs/SYNC.md,
        "Pulling by replay"). pull() always gets every tensor.
    """

    def __init__(self, servers, job, key=None, server_keys=None, insecure_plaintext=False,
                 timeout_ms=30000, connect_timeout_ms=5000, retries=2, client_name="site",
                 pull_by_replay=True):
        if isinstance(servers, str):
            servers = [servers]
        public = secret = ""
        server_public = []
        if not insecure_plaintext:
            if key is None or not server_keys:
                raise ValueError("give key= (this rank's key pair file) and server_keys= (the "
                                 "shards' public key files), or insecure_plaintext=True")
            if isinstance(server_keys, str):
                server_keys = [server_keys]
            public, secret = load_keypair(str(key))
            server_public = [load_public_key(str(p)) for p in server_keys]
        self._core = _isthmus.SiteClient(
            job=job, servers=list(servers), server_public_keys=server_public,
            public_key=public, secret_key=secret, insecure_plaintext=insecure_plaintext,
            timeout_ms=_count("timeout_ms", timeout_ms, 1),
            connect_timeout_ms=_count("connect_timeout_ms", connect_timeout_ms, 1),
            retries=_count("retries", retries), client_name=client_name)
        self._core.set_pull_by_replay(bool(pull_by_replay))
        self.job = job
        self.servers = list(servers)

    def hello(self, base_hash=""):
        """Says hello to every shard as a worker. base_hash: the hash of the base model
        this rank trains on (empty: not checked). Returns one dict per shard (shard_id,
        job_version, tensor_count, local_round, committed_round, max_rounds_ahead,
        push_part_bytes: the size of the parts large pushes go in, 0 for whole, ...).
        Raises ShardError: FailedPrecondition for another base model, NotFound when a
        shard has no such job, PermissionDenied for a key not allowed, Timeout."""
        return self._core.hello(base_hash)

    def encode_deltas(self, threads=4, keep_pipelines_in=None):
        """From now on push_round and start_round encode each round's deltas here, with
        the pipelines the shards choose and error feedback in a residual this Site keeps
        (isthmus-worker --encode-deltas; docs/SYNC.md, "Deltas encoded by the worker"):
        the few MB the WAN carries go to the shards instead of the fp32 deltas. threads:
        how many threads encode a round (0: push fp32 again, dropping the residual).
        keep_pipelines_in: a file where each round's pipelines are written before its
        bytes are pushed, so that a process that restarts in the middle of a round's push
        encodes it again alike (with encoder_residuals() from before that round). A job
        that does not sync gets the fp32 deltas. Several ranks: each encodes the shards it
        pushes."""
        self._core.encode_deltas(_count("threads", threads),
                                 "" if keep_pipelines_in is None else str(keep_pipelines_in))

    def encoder_residuals(self):
        """{name: float32 array (flat)}: the update encode_deltas has not sent yet, after
        the last round every shard took; save it with a checkpoint of the model."""
        return self._core.encoder_residuals()

    def set_encoder_residuals(self, residuals):
        """Starts from saved encoder_residuals() (after encode_deltas)."""
        self._core.set_encoder_residuals(
            {n: _as_float32_buffer(n, v) for n, v in dict(residuals).items()})

    def pull(self):
        """The job's merged tensors from every shard: {name: numpy.float32 array}. The
        arrays point into the received messages (no copy) and own them. Also records
        which shard holds each tensor (placement)."""
        return self._core.pull()

    def push_round(self, round, deltas, tokens=0, compute_ms=0, rank=0, world=1):
        """Pushes round `round`'s change of each tensor ({name: array}) to the shard that
        holds it; with several ranks, rank r pushes the shards s with s % world == r (pass
        every delta; each rank sends its shards' part). tokens: tokens the site trained
        this round; compute_ms: its compute time (adaptive codecs size by it). Returns one
        dict per shard pushed (shard, key, duplicate, tensors, rounds). duplicate=True:
        the shard had this round already and applied nothing twice.
        Raises ValueError for a round below 1, negative tokens or compute_ms, or a rank
        outside 0..world-1 (TypeError for non-integers), before anything is sent."""
        return self._core.push_round(*_round_args(round, deltas, tokens, compute_ms, rank,
                                                  world))

    def check_staleness(self):
        """The rounds of every shard: too_far_ahead, shard, rounds_ahead, limit, reason."""
        return self._core.check_staleness()

    def wait_within_staleness(self, timeout_s=3600.0, poll_s=0.05):
        """Waits until no shard is more than its max_rounds_ahead past its last commit, or
        timeout_s passed; returns the last check_staleness() state (too_far_ahead is True
        on timeout)."""
        return self._core.wait_within_staleness(float(timeout_s), float(poll_s))

    @property
    def placement(self):
        """{tensor name: shard index}, from the last pull (or set_placement)."""
        return self._core.placement

    def set_placement(self, placement):
        self._core.set_placement(dict(placement))

    @property
    def num_shards(self):
        return self._core.num_shards

    def push_key(self, round, shard):
        """The idempotency key push_round uses for `round` on `shard`."""
        return self._core.push_key(int(round), int(shard))

    # -- a round in the background (the round driver, common/round_driver.h) -------------

    def start_round(self, round, deltas, tokens=0, compute_ms=0, rank=0, world=1, pull=True,
                    overlap=True, wait_timeout_s=0.0, poll_s=0.05):
        """Starts round `round` on a background thread: push_round of `deltas` (copied
        before this returns), then, with pull=True (rank 0 of a site), a wait until every
        shard holds the round and the site is within the staleness bound, and a pull. The
        bound counts the round the caller trains meanwhile when overlap=True: the round
        comes within max_rounds_ahead - 1 (see docs/SYNC.md, "The overlapped round").
        wait_timeout_s > 0 fails the round (ShardError "Timeout") when the wait takes
        longer. Until wait_round() returns, the other calls on this Site raise
        RuntimeError (the site client belongs to that thread)."""
        self._core.start_round(*_round_args(round, deltas, tokens, compute_ms, rank, world),
                               bool(pull), bool(overlap), float(wait_timeout_s), float(poll_s))

    def round_state(self):
        """Where the round started with start_round is: "idle" (none), "pushing",
        "waiting", "pulling", "done" or "failed" (wait_round will not block on the last
        two)."""
        return self._core.round_state()

    def await_round_bound(self):
        """Blocks until the round in flight is past its wait for the WAN (with
        max_rounds_ahead 0: until it has committed); returns the seconds it blocked."""
        return self._core.await_round_bound()

    def wait_round(self):
        """Blocks until the round in flight is done and returns what it did: round,
        pushes (one dict per shard, as push_round's), pushed, staleness, push_s, wait_s,
        pull_s, blocked_s (this call's wait), waited, limit (max_rounds_ahead as the shards
        said) and pulled ({name: float32 array}, or None on a rank that does not pull).
        None when no round is in flight. Raises ShardError for the round's failure (its
        push, wait or pull), naming the round and the shard."""
        return self._core.wait_round()

    def cancel_round(self):
        """Gives up the wait for the WAN of the round in flight: wait_round then raises
        ShardError "Unavailable" (used when another rank of the site failed)."""
        self._core.cancel_round()
