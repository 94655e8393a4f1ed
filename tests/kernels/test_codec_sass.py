"""The lossless decode kernel's machine code for an H100 (sm_90), compiled here without a GPU by the
GPU image's Triton (3.6): the loop over steps stays at its measured length.

The decoder is bound by instruction issue (benchmarks/codec/NOTES.md), so the loop's length is its
speed on the device, readable before any device time is spent. It went from 172 to 130
instructions per step of 4 symbols (Triton 3.6) by advancing the stream once per step and storing
each lane's 4 values as one 8-byte word; a change that lengthens it fails here.
"""

import re
import subprocess
import sys

import pytest

from tests.helpers import REPO, triton36_env

_SCRIPT = """
import collections, json, re
from benchmarks.codec.codec_sass import decode_sass, longest_loop
out = {}
for pairs in (True, False):
    body = longest_loop(decode_sass(32, pairs))
    ops = collections.Counter(re.sub(r"^@!?U?P\\w+\\s+", "", t).split()[0] for t in body)
    out[str(pairs)] = {"length": len(body), "ops": ops}
print("RESULT " + json.dumps(out))
"""


def test_decode_loop_for_sm90_is_at_most_130_instructions_a_step_with_one_8_byte_store():
    env, reason = triton36_env()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    loops = json.loads(proc.stdout.split("RESULT ", 1)[1])
    paired, single = loops["True"], loops["False"]
    stores = {op: n for op, n in paired["ops"].items() if op.startswith("STG")}
    assert paired["length"] <= 130, (paired["length"], paired["ops"])
    assert stores == {"STG.E.64": 1}, stores  # the lane's 4 bf16 values: one 8-byte store a step
    # Global loads a step: 8 with Triton 3.6 (the 4 symbols' table lookups, the tails, the stream words).
    loads = sum(n for op, n in paired["ops"].items() if re.match(r"LDG", op))
    assert loads <= 8, paired["ops"]
    # The per-element store (unaligned output) is the fallback: 4 stores a step, and a longer loop.
    assert sum(n for op, n in single["ops"].items() if op.startswith("STG")) == 4, single["ops"]
