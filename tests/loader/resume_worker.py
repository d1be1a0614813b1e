"""``python -m tests.loader.resume_worker SPEC.json OUT.json``: one leg of a resume-equality test.

Runs :func:`tests.loader.helpers.run_worker` in a process of its own (``ray_address`` in the spec's
kwargs joins the test's Ray session) and writes its result as JSON.
"""

import json
import sys

from tests.loader.helpers import run_worker

if __name__ == "__main__":
    spec_path, out_path = sys.argv[1:3]
    with open(spec_path) as f:
        spec = json.load(f)
    result = run_worker(spec)
    with open(out_path, "w") as f:
        json.dump(result, f)
