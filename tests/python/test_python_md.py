"""docs/PYTHON.md as a reader meets it (issue 27 item 11): its API table names everything
public in the package, and its complete example runs as written, from the repository root
of a build, without PYTHONPATH from the caller: it trains both sites, exits 0 only after
`isthmusctl sync verify` found them agreeing on every round, and writes nothing into the
repository."""

import inspect
import os
import re
import shutil
import subprocess
import tempfile
import time
import unittest

import harness
import isthmus
import isthmus.gpt2
import isthmus.llama
import isthmus.torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOC = os.path.join(REPO, "docs", "PYTHON.md")


def read_doc():
    with open(DOC) as f:
        return f.read()


def api_table(doc):
    """The rows of the table under "## The API"."""
    section = doc.split("## The API", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("| `"))


def example_script(doc):
    """The shell block of "A complete example" (the one that runs site_a.py)."""
    section = doc.split("## A complete example", 1)[1]
    blocks = [b.split("```", 1)[0] for b in section.split("```sh\n")[1:]]
    [script] = [b for b in blocks if "SITE_A" in b]
    return script


def site_a(doc):
    blocks = [b.split("```", 1)[0] for b in doc.split("```python\n")[1:]]
    [script] = [b for b in blocks if b.startswith("# site_a.py")]
    return script


def public(names):
    return {n for n in names if not n.startswith("_")}


class ApiTableTest(unittest.TestCase):
    def test_the_table_names_every_public_name(self):
        table = api_table(read_doc())

        def missing(names):
            return sorted(n for n in names if not re.search(r"\b" + re.escape(n) + r"\b", table))

        self.assertEqual(missing(isthmus.__all__), [])
        self.assertEqual(missing(public(vars(isthmus.Site))), [])
        self.assertEqual(missing(["job", "servers"]), [])  # Site's attributes
        self.assertEqual(missing(inspect.signature(isthmus.Site).parameters), [])
        self.assertEqual(missing(isthmus.torch.__all__), [])
        self.assertEqual(missing(public(vars(isthmus.torch.SiteRank))), [])
        self.assertEqual(missing(inspect.signature(isthmus.torch.SiteRank).parameters), [])
        self.assertEqual(missing(["round"]), [])  # SiteRank.round
        gpt2 = {n for n, v in vars(isthmus.gpt2).items()
                if not n.startswith("_") and getattr(v, "__module__", "") == "isthmus.gpt2"}
        self.assertEqual(missing(gpt2), [])
        own = public(n for n, v in vars(isthmus.gpt2.Gpt2Lora).items() if callable(v))
        self.assertEqual(missing(own - {"forward"}), [])  # forward: model(x), as any Module
        llama = {n for n, v in vars(isthmus.llama).items()
                 if not n.startswith("_") and getattr(v, "__module__", "") == "isthmus.llama"}
        self.assertEqual(missing(llama), [])
        own = public(n for n, v in vars(isthmus.llama.LlamaLora).items() if callable(v))
        self.assertEqual(missing(own - {"forward"}), [])
        # The table's own defaults are the package's.
        for param in inspect.signature(isthmus.Site).parameters.values():
            if param.default is not inspect.Parameter.empty:
                self.assertIn(f"{param.name}={param.default!r}".replace("'", '"'), table)


class ExampleTest(unittest.TestCase):
    def test_the_complete_example_runs_as_written(self):
        doc = read_doc()
        build = os.path.dirname(os.path.dirname(os.environ["ISTHMUS_SERVER"]))
        tmp = tempfile.mkdtemp(prefix="isthmus-pymd-")
        try:
            with open(os.path.join(tmp, "site_a.py"), "w") as f:
                f.write(site_a(doc))
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            env.update(SITE_A=os.path.join(tmp, "site_a.py"), B=build, TMPDIR=tmp,
                       PA=str(harness.free_port_range(3)),
                       PB=str(harness.free_port_range(3)),
                       MASTER_PORT=str(harness.free_port()))
            before = sorted(os.listdir(REPO))
            t0 = time.monotonic()
            r = subprocess.run(["bash", "-c", example_script(doc)], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=280)
            elapsed = time.monotonic() - t0
            print(f"the example took {elapsed:.0f} s")
            [ex] = [d for d in os.listdir(tmp) if d.startswith("isthmus-example-")]
            logs = ""
            for name in ("worker-B.log", "server-A.log", "server-B.log"):
                path = os.path.join(tmp, ex, name)
                if os.path.exists(path):
                    with open(path) as f:
                        logs += f"--- {name}\n" + f.read()[-1500:]
            self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-3000:] + logs)
            self.assertIn(f"working in {os.path.join(tmp, ex)}", r.stdout)
            self.assertIn("2 sites agree on rounds 0..5", r.stdout)
            self.assertIn("committed: A 5, B 5", r.stdout)
            for rnd in range(1, 6):
                self.assertIn(f"round {rnd}: loss", r.stdout)
            self.assertEqual(sorted(os.listdir(REPO)), before, "the example wrote into the repository")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
