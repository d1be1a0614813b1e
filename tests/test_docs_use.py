"""docs/use.md runs as written: every ``python`` block is written to the file its first line names, every
``bash`` block is run, in order, in a fresh directory, with the venv's commands on PATH and the test's own Ray
session as ``RAY_ADDRESS`` (loopback only). Then what each example printed is checked."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "use.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


def blocks() -> list[tuple[str, str]]:
    return BLOCK.findall(PAGE.read_text())


def test_every_block_is_a_file_or_a_command():
    kinds = [kind for kind, _ in blocks()]
    assert set(kinds) == {"python", "bash"} and kinds.count("python") == 4
    for kind, text in blocks():
        if kind == "python":
            assert re.match(r"# file: \w+\.py\n", text), text.splitlines()[0]


def test_the_examples_run(ray_address, tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ray_address, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    output = []
    for kind, text in blocks():
        if kind == "python":
            name = text.splitlines()[0].removeprefix("# file: ")
            (tmp_path / name).write_text(text)
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 0, f"{text}\n{done.stdout}\n{done.stderr[-4000:]}"
        output.append(done.stdout)
    synth, torchrun, dataloader, ray_train, nested = output

    # torchrun: both ranks, both epochs, every history once per epoch
    got = re.findall(r"rank (\d) epoch (\d): (\d+) histories", torchrun)
    assert sorted((r, e) for r, e, _ in got) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    for epoch in "01":
        assert sum(int(n) for _, e, n in got if e == epoch) == 2000

    # StatefulDataLoader: 10 microbatches, then the rest of the epoch after the resume (4 per step)
    first, rest = (int(n) for n in re.findall(r": (\d+) microbatches", dataloader))
    steps = -(-2000 // 256)
    assert first == 10 and first + rest == 4 * steps

    # Ray Train: both workers; every history once
    counts = [int(n) for n in re.findall(r"worker \d: (\d+) histories", ray_train)]
    assert len(counts) == 2 and sum(counts) == 2000 and "trained; last checkpoint:" in ray_train

    # nested: one microbatch's histories through SDPA, 64-wide values
    assert re.search(r"attention over \d+ histories, \(\d+, 64\) values", nested)
