"""Test harness for the Python package: real isthmus-server processes on loopback with
CURVE keys, jobs created with the real isthmusctl. The binaries come from the environment
ctest sets (ISTHMUS_SERVER, ISTHMUS_CTL, ISTHMUS_WORKER)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import isthmus

# free_port(), free_port_range(n): loopback ports outside the kernel's ephemeral range,
# claimed for this process so that tests running side by side never share one
# (deploy/free_port.py says why).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "deploy"))
from free_port import free_port, free_port_range  # noqa: E402


def shard_key(root, site, i):
    """The key pair prefix of shard i of `site` under `root` (written if missing)."""
    prefix = os.path.join(root, "keys", f"{site}-{i}")
    if not os.path.exists(prefix + ".key"):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        isthmus.write_keypair(prefix)
    return prefix


class Site:
    """One site: `shards` isthmus-server processes sharing a worker key and an admin key.
    name: the site's name (files under root are named by it); root: a folder shared with
    other sites (default: a fresh one, removed by close()); peer_listen: give each shard a
    peer listener (on peer_ports[i] when given) and the allowlist root/keys/peers-i/ (needed
    with sync.peers in extra_config); peer_pubs: public key files copied into every such
    allowlist before the shards start (a shard refuses to start on an empty one)."""

    def __init__(self, shards=1, extra_config="", peer_listen=False, name="py", root=None,
                 peer_ports=None, peer_pubs=()):
        self.own_dir = root is None
        self.dir = root or tempfile.mkdtemp(prefix="isthmus-py-")
        self.name = name
        self.server_bin = os.environ["ISTHMUS_SERVER"]
        self.ctl_bin = os.environ["ISTHMUS_CTL"]
        keys = os.path.join(self.dir, "keys")
        os.makedirs(os.path.join(keys, f"workers-{name}"), exist_ok=True)
        os.makedirs(os.path.join(keys, "admins"), exist_ok=True)
        self.worker_key = os.path.join(keys, f"workers-{name}", "w0.key")
        self.admin_key = os.path.join(keys, "admins", "a0.key")
        if not os.path.exists(self.worker_key):
            isthmus.write_keypair(self.worker_key[:-4])
        if not os.path.exists(self.admin_key):
            isthmus.write_keypair(self.admin_key[:-4])
        self.procs, self.worker_eps, self.admin_eps, self.server_pubs = [], [], [], []
        for i in range(shards):
            prefix = shard_key(self.dir, name, i)
            self.server_pubs.append(prefix + ".pub")
            wp, ap = free_port(), free_port()
            self.worker_eps.append(f"tcp://127.0.0.1:{wp}")
            self.admin_eps.append(f"tcp://127.0.0.1:{ap}")
            peer = ""
            if peer_listen:
                pp = peer_ports[i] if peer_ports else free_port()
                os.makedirs(os.path.join(keys, f"peers-{i}"), exist_ok=True)
                for pub in peer_pubs:
                    shutil.copy(pub, os.path.join(keys, f"peers-{i}"))
                peer = f'peer = "tcp://127.0.0.1:{pp}"\n'
            conf = os.path.join(self.dir, f"{name}-shard{i}.toml")
            with open(conf, "w") as f:
                f.write(f'[shard]\nid = "{name}-{i}"\nindex = {i}\n'
                        f'data_dir = "{self.dir}/{name}-data{i}"\n'
                        f'[listen]\nworker = "{self.worker_eps[i]}"\n'
                        f'admin = "{self.admin_eps[i]}"\n' + peer
                        + f'[security]\nsecret_key = "{prefix}.key"\n'
                        f'worker_keys = ["{keys}/workers-{name}"]\n'
                        f'admin_keys = ["{keys}/admins"]\n'
                        + (f'peer_keys = ["{keys}/peers-{i}"]\n' if peer_listen else "")
                        + extra_config)
            with open(os.path.join(self.dir, f"{name}-shard{i}.log"), "w") as log:
                self.procs.append(subprocess.Popen([self.server_bin, "--config", conf],
                                                   stdout=log, stderr=subprocess.STDOUT))
        self._wait_ready()

    def _wait_ready(self):
        deadline = time.monotonic() + 20
        for i in range(len(self.procs)):
            client = isthmus.Site(self.worker_eps[i], job="probe", key=self.worker_key,
                                  server_keys=self.server_pubs[i], timeout_ms=300, retries=0)
            while True:
                if self.procs[i].poll() is not None:
                    raise RuntimeError(f"shard {i} exited: " + self.log(i))
                try:
                    client.hello()
                except isthmus.ShardError as e:
                    if e.code not in ("Timeout", "Unavailable"):
                        break  # answered (NotFound: no such job): the shard is up
                if time.monotonic() > deadline:
                    raise RuntimeError(f"shard {i} did not answer in 20 s: " + self.log(i))

    def log(self, i):
        with open(os.path.join(self.dir, f"{self.name}-shard{i}.log")) as f:
            return f.read()

    def client(self, job, **kw):
        return isthmus.Site(self.worker_eps, job=job, key=self.worker_key,
                            server_keys=self.server_pubs, **kw)

    def ctl(self, *args, servers=None):
        cmd = [self.ctl_bin, *args]
        for ep in self.admin_eps if servers is None else servers:
            cmd += ["--server", ep]
        for pub in self.server_pubs if servers is None else self.server_pubs[:len(servers)]:
            cmd += ["--server-key", pub]
        cmd += ["--key", self.admin_key]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    def create_job(self, job, tensors, base_hash="base-1", path=None):
        """Creates `job` from {name: array} (or from the safetensors file `path`)."""
        if path is None:
            path = os.path.join(self.dir, f"{self.name}-{job}.safetensors")
            isthmus.write_safetensors(path, tensors)
        r = self.ctl("job", "create", "--job", job, "--from", path, "--base-hash", base_hash)
        if r.returncode != 0:
            raise RuntimeError(f"job create failed ({r.returncode}): {r.stderr}")

    def describe(self, job):
        """The job's tensors: [{name, shape, shard, version}]."""
        r = self.ctl("job", "describe", "--job", job, "--json")
        if r.returncode != 0:
            raise RuntimeError(f"job describe failed ({r.returncode}): {r.stderr}")
        return json.loads(r.stdout)

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def synced_sites(names=("A", "B"), sync_config=""):
    """Sites of one shard each that sync with each other. Returns (root, {name: Site});
    close each Site, then remove root."""
    root = tempfile.mkdtemp(prefix="isthmus-py-sites-")
    ports = {(n, 0): free_port() for n in names}
    os.makedirs(os.path.join(root, "keys", "peers-0"), exist_ok=True)
    for n in names:
        shutil.copy(shard_key(root, n, 0) + ".pub", os.path.join(root, "keys", "peers-0", f"{n}.pub"))
    sites = {}
    try:
        for n in names:
            peers = ", ".join(
                f'"{m}=tcp://127.0.0.1:{ports[(m, 0)]}={shard_key(root, m, 0)}.pub"'
                for m in names if m != n)
            sites[n] = Site(shards=1, name=n, root=root, peer_listen=True,
                            peer_ports=[ports[(n, 0)]],
                            extra_config=f'[sync]\nsite = "{n}"\npeers = [{peers}]\n'
                            + sync_config)
    except Exception:
        for site in sites.values():
            site.close()
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root, sites


class ShardsTestCase(unittest.TestCase):
    """Tests sharing one running site of SHARDS shards (self.shards), started once."""

    SHARDS = 2

    @classmethod
    def setUpClass(cls):
        cls.shards = Site(shards=cls.SHARDS)

    @classmethod
    def tearDownClass(cls):
        cls.shards.close()
