"""Put on PYTHONPATH by tests/test_bench_cli.py: the packages named in $BLOCKED_MODULES cannot be imported, as if
they were not installed, so that a test sees what a user without them sees."""
import os
import sys

BLOCKED = set(filter(None, os.environ.get("BLOCKED_MODULES", "").split(",")))


class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Blocked())
