"""PyTorch's generic backend suite (torch.testing._internal.distributed.distributed_test, shipped in the wheel) on
one backend, as torch's test/distributed/test_distributed_spawn.py drives it. Not a pytest module: compare.py runs
it once per backend (`make test-torch-suite`).

The suite gates many tests on the backend's NAME when it is imported (e.g. "requires backend to be one of
{'gloo'}"): it is imported as gloo, and every test then initializes BACKEND_UNDER_TEST. Writes {test: status} as JSON
to SUITE_RESULTS. Environment: BACKEND_UNDER_TEST (gloo or cocosync), WORLD_SIZE (2), SUITE_PATTERNS (unittest -k
patterns, comma-separated; empty: all), SUITE_RESULTS (path)."""

import json
import os
import sys
import tempfile
import unittest

import cocosync  # noqa: F401 - registers the "cocosync" backend, also in every spawned rank (they import this)

os.environ["BACKEND"] = "gloo"
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:  # compare.py gives one (and removes it); spawned ranks inherit the parent's
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="cocosync-suite-")
import torch.testing._internal.distributed.distributed_test as suite  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

suite.BACKEND = os.environ.get("BACKEND_UNDER_TEST", "cocosync")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


def main() -> int:
    loader = unittest.TestLoader()
    patterns = [p for p in os.environ.get("SUITE_PATTERNS", "").split(",") if p]
    if patterns:
        loader.testNamePatterns = [f"*{p}*" for p in patterns]
    tests = loader.loadTestsFromTestCase(TestDistBackendWithSpawn)
    status = {t.id().rsplit(".", 1)[-1]: "passed" for t in tests}  # before running: the suite drops them as it goes
    result = unittest.TextTestRunner(verbosity=1, stream=sys.stderr).run(tests)
    for kind, items in (("failed", result.failures), ("error", result.errors)):
        for t, _ in items:
            status[t.id().rsplit(".", 1)[-1]] = kind
    for t, why in result.skipped:
        status[t.id().rsplit(".", 1)[-1]] = f"skipped: {why}"
    with open(os.environ["SUITE_RESULTS"], "w") as f:
        json.dump(status, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
