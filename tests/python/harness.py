"""Test harness for the Python package: real isthmus-server processes on loopback with
CURVE keys, jobs created with the real isthmusctl. The binaries come from the environment
ctest sets (ISTHMUS_SERVER, ISTHMUS_CTL, ISTHMUS_WORKER)."""

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time

import numpy as np

import isthmus


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: float32 array} as a safetensors file (little-endian F32)."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        blobs.append(a.tobytes())
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


class Site:
    """One site: `shards` isthmus-server processes sharing a worker key and an admin key.
    peer_listen: give each a peer listener (needed with sync.peers in extra_config)."""

    def __init__(self, shards=1, extra_config="", peer_listen=False):
        self.dir = tempfile.mkdtemp(prefix="isthmus-py-")
        self.server_bin = os.environ["ISTHMUS_SERVER"]
        self.ctl_bin = os.environ["ISTHMUS_CTL"]
        keys = os.path.join(self.dir, "keys")
        for sub in ("workers", "admins"):
            os.makedirs(os.path.join(keys, sub))
        isthmus.write_keypair(os.path.join(keys, "workers", "w0"))
        isthmus.write_keypair(os.path.join(keys, "admins", "a0"))
        self.worker_key = os.path.join(keys, "workers", "w0.key")
        self.admin_key = os.path.join(keys, "admins", "a0.key")
        self.procs, self.worker_eps, self.admin_eps, self.server_pubs = [], [], [], []
        for i in range(shards):
            isthmus.write_keypair(os.path.join(keys, f"shard{i}"))
            self.server_pubs.append(os.path.join(keys, f"shard{i}.pub"))
            wp, ap = free_port(), free_port()
            self.worker_eps.append(f"tcp://127.0.0.1:{wp}")
            self.admin_eps.append(f"tcp://127.0.0.1:{ap}")
            conf = os.path.join(self.dir, f"shard{i}.toml")
            with open(conf, "w") as f:
                f.write(f'[shard]\nid = "py-{i}"\nindex = {i}\n'
                        f'data_dir = "{self.dir}/data{i}"\n'
                        f'[listen]\nworker = "{self.worker_eps[i]}"\n'
                        f'admin = "{self.admin_eps[i]}"\n'
                        + (f'peer = "tcp://127.0.0.1:{free_port()}"\n' if peer_listen else "")
                        + f'[security]\nsecret_key = "{keys}/shard{i}.key"\n'
                        f'worker_keys = ["{keys}/workers"]\nadmin_keys = ["{keys}/admins"]\n'
                        + extra_config)
            log = open(os.path.join(self.dir, f"shard{i}.log"), "w")
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
                    if e.code != "Timeout":
                        break  # answered (NotFound: no such job): the shard is up
                if time.monotonic() > deadline:
                    raise RuntimeError(f"shard {i} did not answer in 20 s: " + self.log(i))

    def log(self, i):
        with open(os.path.join(self.dir, f"shard{i}.log")) as f:
            return f.read()

    def client(self, job, **kw):
        return isthmus.Site(self.worker_eps, job=job, key=self.worker_key,
                            server_keys=self.server_pubs, **kw)

    def ctl(self, *args, servers=None):
        cmd = [self.ctl_bin, *args]
        for ep in servers or self.admin_eps:
            cmd += ["--server", ep]
        for pub in self.server_pubs if servers is None else self.server_pubs[:len(servers)]:
            cmd += ["--server-key", pub]
        cmd += ["--key", self.admin_key]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    def create_job(self, job, tensors, base_hash="base-1"):
        path = os.path.join(self.dir, f"{job}.safetensors")
        write_safetensors(path, tensors)
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
        shutil.rmtree(self.dir, ignore_errors=True)
