"""SASS of the lossless decode kernel for an H100 (sm_90), compiled on a machine without a GPU.

Triton compiles for a named target without a driver, and its wheel ships ``ptxas`` and
``cuobjdump``; so the instruction count of the decode loop, the issue bound of a
decoder that is bound by instruction issue (benchmarks/codec/NOTES.md), can be read
before any device time is spent. Prints the loop's instruction count (the longest
backward branch: the loop over steps) and its opcode mix; ``--sass FILE`` keeps the
listing. The default geometry: 32 steps, 256 lanes, 4 elements, 8 warps, even size,
8-byte aligned output.

    env -u TRITON_INTERPRET python benchmarks/codec/codec_sass.py [--steps 16] [--sass decode.sass]

Not a timing: the Triton here may differ from the device's (the loop differs between
versions), so compare two kernels compiled by the same Triton.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SIGNATURE = {"stream_ptr": "*i32", "lane_words_ptr": "*u8", "tile_base_ptr": "*i64", "tails_ptr": "*u8",
             "lut_ptr": "*i16", "tile_ids_ptr": "*i64", "out_ptr": "*i16", "N": "i32"}


def decode_sass(steps: int, pairs: bool) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from neutrain.kernels import codec as kcodec

    constants = {"S": steps, "L": 256, "E": 4, "EVEN": True, "HAS_IDS": False, "FUNNEL": True, "PAIRS": pairs}
    source = ASTSource(fn=kcodec._decode_wide_kernel, signature={**SIGNATURE, **dict.fromkeys(constants, "constexpr")},
                       constexprs=constants)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp, "decode.cubin")
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


def longest_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body."""
    listing = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", sass)]
    index = {address: i for i, (address, _) in enumerate(listing)}
    best: list[str] = []
    for i, (address, text) in enumerate(listing):
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in index:
            body = [t for _, t in listing[index[int(target.group(1), 16)]: i + 1]]
            best = max(best, body, key=len)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--no-pairs", action="store_true", help="the per-element store (unaligned output)")
    parser.add_argument("--sass", help="write the listing here")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    sass = decode_sass(args.steps, not args.no_pairs)
    if args.sass:
        Path(args.sass).write_text(sass)
    body = longest_loop(sass)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    print(f"decode loop: {len(body)} instructions per step of 4 symbols ({len(body) / 4:.1f} per symbol)")
    print("opcodes:", ", ".join(f"{op} {n}" for op, n in ops.most_common()))


if __name__ == "__main__":
    main()
