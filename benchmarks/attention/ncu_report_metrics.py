"""Read metric values out of Nsight Compute ``.ncu-rep`` files without Nsight Compute, and compare two kernels.

The report is decoded from the protobuf wire format alone (no ``.proto`` schema): varints, fixed32/fixed64
and length-delimited fields, recursing into length-delimited fields that parse as messages. The layout this
reader relies on was found by inspecting reports written by Nsight Compute 2025.3.1 (the two reports in
``benchmarks/<topic>/results.jsonl``) and is checked on every file it reads:

* The file is a short magic (``NVR\\0``) followed by records, each a little-endian uint32 byte count and one
  protobuf message. The framing is found by trying start offsets until the records tile the file exactly.
* A block-header record holds the metric-name string table: a sub-message made only of repeated field 1
  strings (``launch__grid_size``, ``launch__grid_dim_x``, ...). The record after it (the payload the
  header's size field announces) is the profile result of one kernel launch.
* In the result, each metric is one sub-message ``{1: name index (varint), 2: value, 3: instance*, 4: varint}``;
  the name index points into the string table of the header before it.
* A value is a sub-message with one field, whose number gives the type: 1 = string, 3 = fixed64 holding an
  IEEE double, 5 = varint holding an unsigned integer. These three were verified against metrics with known
  values (``launch__block_size`` 384, ``launch__grid_size``, ``launch__sm_count`` 132 on an H200,
  ``launch__waves_per_multiprocessor`` = grid / SMs as a fraction, ``gpu__time_duration.sum`` in ns).
  Any other field number or wire type is kept with ``"ambiguous": true`` and never printed in the table.
* Instanced values (field 3) are ``{1: key value, 2: value}`` pairs, decoded the same way.
* Some records (device attributes) hold ``{1: name string, 2: value}`` pairs directly; those are read too.

    python benchmarks/attention/ncu_report_metrics.py gluon=ncu_gluon.ncu-rep cudnn=ncu_cudnn.ncu-rep [--json OUT]
    python benchmarks/attention/ncu_report_metrics.py --dump REPORT      # the raw message tree, for inspection
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from pathlib import Path

WIRE_VARINT, WIRE_I64, WIRE_LEN, WIRE_I32 = 0, 1, 2, 5

#: value-message field number -> type name, as verified (see the module docstring)
VALUE_TYPES = {1: "string", 3: "double", 5: "uint64"}


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


#: An unverified fixed-width value's wire type -> (type name, float format, integer format, integer key).
FIXED_WIDTH = {WIRE_I64: ("fixed64?", "<d", "<Q", "as_uint64"), WIRE_I32: ("fixed32?", "<f", "<I", "as_uint32")}


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def parse_message(buf: bytes) -> list[tuple[int, int, object]]:
    """Decode one message into (field, wire type, value) triples; raise WireError unless it parses exactly.

    Values: int for varints, 8 or 4 raw bytes for fixed64/fixed32, bytes for length-delimited fields.
    """
    fields = []
    pos = 0
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if field == 0 or field > (1 << 29) - 1:
            raise WireError(f"bad field number {field}")
        if wire == WIRE_VARINT:
            value, pos = read_varint(buf, pos)
        elif wire == WIRE_I64:
            if pos + 8 > len(buf):
                raise WireError("truncated fixed64")
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == WIRE_I32:
            if pos + 4 > len(buf):
                raise WireError("truncated fixed32")
            value, pos = buf[pos : pos + 4], pos + 4
        elif wire == WIRE_LEN:
            size, pos = read_varint(buf, pos)
            if pos + size > len(buf):
                raise WireError("length-delimited field runs past the end")
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise WireError(f"unsupported wire type {wire}")
        fields.append((field, wire, value))
    return fields


def try_message(buf: bytes) -> list | None:
    """The parsed fields when ``buf`` is a non-empty message, else None."""
    if not buf:
        return None
    try:
        return parse_message(buf)
    except WireError:
        return None


def is_text(buf: bytes) -> bool:
    try:
        text = buf.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(ch.isprintable() or ch in "\n\t\r" for ch in text)


def looks_like_submessage(buf: bytes) -> list | None:
    """Fields of ``buf`` when it reads as a message rather than text: short printable strings often also
    parse as messages (``b'(@'`` is field 5 = 64), so text of 6 or more printable bytes is taken as text."""
    fields = try_message(buf)
    if fields is None:
        return None
    if len(buf) >= 6 and is_text(buf):
        return None
    return fields


# --------------------------------------------------------------------------------------------- framing


def split_records(data: bytes, max_header: int = 64) -> tuple[int, list[bytes]]:
    """(offset of the first record, the records) where the file from that offset is a chain of
    uint32-LE-length-prefixed messages ending exactly at EOF. Offsets 0..max_header are tried in order."""
    for start in range(0, min(max_header, len(data)) + 1):
        records = []
        pos = start
        ok = True
        while pos < len(data):
            if pos + 4 > len(data):
                ok = False
                break
            (size,) = struct.unpack_from("<I", data, pos)
            body = data[pos + 4 : pos + 4 + size]
            if pos + 4 + size > len(data) or (size and try_message(body) is None):
                ok = False
                break
            records.append(body)
            pos += 4 + size
        if ok and records and pos == len(data):
            return start, records
    # One message after a header, without length prefixes.
    for start in range(0, min(max_header, len(data)) + 1):
        if try_message(data[start:]) is not None:
            return start, [data[start:]]
    raise WireError("no offset makes the file a protobuf record chain")


# ------------------------------------------------------------------------------------------ values


def decode_value(buf: bytes) -> dict | None:
    """A value message -> {"type", "value"} (+ "ambiguous"); None when it is not a one-field message."""
    fields = try_message(buf)
    if fields is None or len(fields) != 1:
        return None
    field, wire, raw = fields[0]
    known = VALUE_TYPES.get(field)
    if known == "string" and wire == WIRE_LEN and is_text(raw):
        return {"type": "string", "value": raw.decode("utf-8")}
    if known == "double" and wire == WIRE_I64:
        return {"type": "double", "value": struct.unpack("<d", raw)[0]}
    if known == "uint64" and wire == WIRE_VARINT:
        if raw >= 1 << 63:  # could be a negative int64; not seen in the verified reports
            return {"type": "uint64", "value": raw, "ambiguous": True, "note": "could be a negative int64"}
        return {"type": "uint64", "value": raw}
    # Anything else: keep the raw reading, flagged.
    note = f"value field {field}, wire type {wire}: type not verified"
    if wire in FIXED_WIDTH:  # read both ways: a float and an unsigned integer of the same bytes
        name, as_float, as_int, int_key = FIXED_WIDTH[wire]
        return {"type": name, "value": struct.unpack(as_float, raw)[0], int_key: struct.unpack(as_int, raw)[0],
                "ambiguous": True, "note": note}
    if wire == WIRE_VARINT:
        return {"type": "varint?", "value": raw, "ambiguous": True, "note": note}
    return {
        "type": "bytes?",
        "value": raw.decode("utf-8") if is_text(raw) else raw.hex(),
        "ambiguous": True,
        "note": note,
    }


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


# ---------------------------------------------------------------------------------------- metrics


def string_table(fields: list) -> list[str] | None:
    """Names when a message is only repeated field-1 strings that look like metric names (``a__b``)."""
    if len(fields) < 2 or any(f != 1 or w != WIRE_LEN for f, w, _ in fields):
        return None
    names = []
    for _, _, raw in fields:
        if not raw or not is_text(raw):
            return None
        names.append(raw.decode("utf-8"))
    if sum("__" in n for n in names) < len(names) // 2:
        return None
    return names


def find_string_table(record: bytes) -> list[str] | None:
    fields = try_message(record)
    for _, wire, raw in fields or []:
        if wire == WIRE_LEN:
            sub = looks_like_submessage(raw)
            if sub is not None:
                table = string_table(sub)
                if table is not None:
                    return table
    return None


def indexed_entry(raw: bytes) -> tuple[int, dict | None, list] | None:
    """``{1: index, 2: value, 3: instance*, 4: varint}`` -> (index, value, instances), else None."""
    fields = looks_like_submessage(raw)
    if fields is None:
        return None
    index = value = None
    instances = []
    for field, wire, v in fields:
        if field == 1 and wire == WIRE_VARINT and index is None:
            index = v
        elif field == 2 and wire == WIRE_LEN and value is None:
            value = decode_value(v)
            if value is None:
                return None
        elif field == 3 and wire == WIRE_LEN:
            inst = try_message(v)
            if inst is None:
                return None
            pair = {}
            for f, w, iv in inst:
                if w == WIRE_LEN and f in (1, 2):
                    pair["key" if f == 1 else "value"] = decode_value(iv)
            instances.append(pair)
        elif field == 4 and wire == WIRE_VARINT:
            pass
        else:
            return None
    if index is None:
        return None
    return index, value, instances


def named_entry(raw: bytes) -> tuple[str, dict] | None:
    """``{1: name string, 2: value message}`` -> (name, value), else None."""
    fields = try_message(raw)
    if fields is None or len(fields) != 2:
        return None
    (f1, w1, name), (f2, w2, val) = fields
    if (f1, w1, f2, w2) != (1, WIRE_LEN, 2, WIRE_LEN) or not is_text(name) or "__" not in name.decode():
        return None
    value = decode_value(val)
    return (name.decode("utf-8"), value) if value is not None else None


def _walk_named(buf: bytes, out: dict, depth: int = 0) -> None:
    fields = looks_like_submessage(buf) if depth else try_message(buf)
    for _, wire, raw in fields or []:
        if wire != WIRE_LEN:
            continue
        hit = named_entry(raw)
        if hit is not None:
            out.setdefault(hit[0], hit[1])
        elif depth < 6:
            _walk_named(raw, out, depth + 1)


def _value_entry(value: dict | None, instances: list) -> dict:
    entry = dict(value) if value is not None else {"type": "none", "value": None}
    if instances:
        entry["instances"] = [
            {k: (v or {}).get("value") for k, v in pair.items()} for pair in instances
        ]
    return entry


def read_report(path: str | Path) -> dict:
    """{"file", "header_offset", "kernels": [{"name", "metrics": {name: value entry}}], "named": {...}}."""
    data = Path(path).read_bytes()
    offset, records = split_records(data)
    table: list[str] | None = None
    kernels = []
    named: dict = {}
    for record in records:
        found = find_string_table(record)
        if found is not None:
            table = found
            continue
        fields = try_message(record) or []
        entries = []
        if table is not None:
            for _, wire, raw in fields:
                if wire == WIRE_LEN:
                    hit = indexed_entry(raw)
                    if hit is not None and hit[0] < len(table):
                        entries.append(hit)
        if len(entries) >= 5 and len({e[0] for e in entries}) == len(entries):
            metrics = {table[i]: _value_entry(v, inst) for i, v, inst in entries}
            strings = [r.decode() for f, w, r in fields if w == WIRE_LEN and r and is_text(r)]
            name = metrics.get("launch__kernel_name", {})
            inst_names = [i.get("value") for i in name.get("instances", []) if i.get("value")]
            kname = name.get("value") or (inst_names[0] if inst_names else None)
            kernels.append({"name": kname or (max(strings, key=len) if strings else "?"), "metrics": metrics})
            table = None  # one result per header; a later result brings its own table
        else:
            _walk_named(record, named)
    return {"file": str(path), "header_offset": offset, "records": len(records), "kernels": kernels, "named": named}


# ----------------------------------------------------------------------------------- sanity checks


def _num(metrics: dict, name: str):
    entry = metrics.get(name)
    if entry is None or entry.get("ambiguous") or entry["type"] not in ("double", "uint64"):
        return None
    return entry["value"]


def sanity_checks(metrics: dict) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) on metrics whose values are fixed by the launch and by each other."""
    checks = []

    def add(label, ok, detail):
        checks.append((label, bool(ok), detail))

    dims = {k: _num(metrics, f"launch__{k}") for k in ("block_dim_x", "block_dim_y", "block_dim_z")}
    block = _num(metrics, "launch__block_size")
    add("block_size = block_dim_x*y*z", block is not None and None not in dims.values()
        and block == math.prod(dims.values()), f"{block} vs {dims}")
    gdims = {k: _num(metrics, f"launch__{k}") for k in ("grid_dim_x", "grid_dim_y", "grid_dim_z")}
    grid = _num(metrics, "launch__grid_size")
    add("grid_size = grid_dim_x*y*z", grid is not None and None not in gdims.values()
        and grid == math.prod(gdims.values()), f"{grid} vs {gdims}")
    sms = _num(metrics, "launch__sm_count")
    add("launch__sm_count = device multiprocessor count", sms is not None
        and sms == _num(metrics, "device__attribute_multiprocessor_count"), f"{sms}")
    waves = _num(metrics, "launch__waves_per_multiprocessor")
    add("waves_per_multiprocessor is a double (>= grid / SMs / occupancy)", isinstance(waves, float) and grid and sms
        and 0 < waves <= grid / sms + 1e-9, f"{waves}")
    regs = _num(metrics, "launch__registers_per_thread")
    add("registers_per_thread in 1..255", regs is not None and 1 <= regs <= 255, f"{regs}")
    dur, cyc, clk = (_num(metrics, n) for n in ("gpu__time_duration.sum", "gpc__cycles_elapsed.max",
                                                 "gpc__cycles_elapsed.avg.per_second"))
    ok = dur and cyc and clk and abs(cyc / clk * 1e9 / dur - 1) < 0.05
    add("gpu__time_duration.sum (ns) = gpc cycles / clock", ok,
        f"{dur} ns vs {cyc / clk * 1e9 if cyc and clk else None}")
    stalls = [v["value"] for k, v in metrics.items()
              if k.startswith("smsp__average_warps_issue_stalled_") and k.endswith("_per_issue_active.ratio")
              and not v.get("ambiguous")]
    lat = _num(metrics, "smsp__average_warp_latency_per_inst_issued.ratio")
    add("stall ratios sum to warp cycles per issued instruction", stalls and lat
        and abs(sum(stalls) / lat - 1) < 0.02, f"{sum(stalls) if stalls else None} vs {lat}")
    per_op = metrics.get("sass__inst_executed_per_opcode", {}).get("instances")
    executed = _num(metrics, "inst_executed")
    if per_op:
        total = sum(i["value"] for i in per_op if isinstance(i.get("value"), (int, float)))
        add("per-opcode instance counts sum to inst_executed", executed and abs(total / executed - 1) < 1e-6,
            f"{total} vs {executed}")
    return checks


# --------------------------------------------------------------------------------------------- table

#: (label, metric, scale, format); rows whose metric is absent in both reports are left out
ROWS = [
    ("Launch", None, None, None),
    ("grid size (blocks)", "launch__grid_size", 1, "{:.0f}"),
    ("block size (threads)", "launch__block_size", 1, "{:.0f}"),
    ("waves per SM", "launch__waves_per_multiprocessor", 1, "{:.2f}"),
    ("registers per thread", "launch__registers_per_thread", 1, "{:.0f}"),
    ("shared memory per block (KiB)", "launch__shared_mem_per_block", 1 / 1024, "{:.1f}"),
    ("  dynamic shared memory (KiB)", "launch__shared_mem_per_block_dynamic", 1 / 1024, "{:.1f}"),
    ("Time", None, None, None),
    ("duration (ms)  gpu__time_duration.sum", "gpu__time_duration.sum", 1e-6, "{:.3f}"),
    ("SM clock (GHz)  gpc__cycles_elapsed.avg.per_second", "gpc__cycles_elapsed.avg.per_second", 1e-9, "{:.3f}"),
    ("SM active cycles (M)  sm__cycles_active.avg", "sm__cycles_active.avg", 1e-6, "{:.2f}"),
    ("instructions executed (G)  inst_executed", "inst_executed", 1e-9, "{:.3f}"),
    ("Compute (% of peak, elapsed)", None, None, None),
    ("SM throughput  sm__throughput", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1, "{:.1f}"),
    ("tensor pipe active  sm__pipe_tensor_cycles_active",
     "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed", 1, "{:.1f}"),
    ("  hmma sub-pipe cycles active (HGMMA bf16, QGMMA fp8)",
     "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed", 1, "{:.1f}"),
    ("  imma sub-pipe cycles active (IGMMA int8)",
     "sm__pipe_tensor_op_imma_cycles_active.avg.pct_of_peak_sustained_elapsed", 1, "{:.1f}"),
    ("  inst_executed_pipe_tensor_op_gmma (wgmma issue)",
     "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_elapsed", 1, "{:.2f}"),
    ("  inst_executed_pipe_tensor_op_hmma",
     "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_elapsed", 1, "{:.2f}"),
    ("  inst_executed_pipe_tensor_op_imma",
     "sm__inst_executed_pipe_tensor_op_imma.avg.pct_of_peak_sustained_elapsed", 1, "{:.2f}"),
    ("issue slots busy  sm__inst_issued", "sm__inst_issued.avg.pct_of_peak_sustained_elapsed", 1, "{:.1f}"),
    ("issue active  sm__issue_active", "sm__issue_active.avg.pct_of_peak_sustained_elapsed", 1, "{:.1f}"),
    ("IPC (inst issued / active cycle / SM)", "sm__inst_issued.avg.per_cycle_active", 1, "{:.2f}"),
    ("XU pipe (MUFU: exp2, rcp) inst executed",
     "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_elapsed", 1, "{:.1f}"),
    ("FMA pipe inst executed", "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_elapsed", 1, "{:.1f}"),
    ("ALU pipe inst executed", "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_elapsed", 1, "{:.1f}"),
    ("LSU pipe inst executed", "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_elapsed", 1, "{:.2f}"),
    ("MIO inst issued", "sm__mio_inst_issued.avg.pct_of_peak_sustained_elapsed", 1, "{:.2f}"),
    ("Memory (% of peak, elapsed)", None, None, None),
    ("memory throughput  gpu__compute_memory_throughput",
     "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", 1, "{:.1f}"),
    ("DRAM throughput  gpu__dram_throughput", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1, "{:.2f}"),
    ("L2 throughput  lts__throughput", "lts__throughput.avg.pct_of_peak_sustained_elapsed", 1, "{:.1f}"),
    ("L1/shared throughput  l1tex__throughput (active)",
     "l1tex__throughput.avg.pct_of_peak_sustained_active", 1, "{:.1f}"),
    ("L2 hit rate (%)", "lts__t_sector_hit_rate.pct", 1, "{:.1f}"),
    ("Occupancy", None, None, None),
    ("theoretical occupancy (%)", "sm__maximum_warps_per_active_cycle_pct", 1, "{:.2f}"),
    ("achieved occupancy (%)  sm__warps_active", "sm__warps_active.avg.pct_of_peak_sustained_active", 1, "{:.2f}"),
    ("achieved active warps per SM", "sm__warps_active.avg.per_cycle_active", 1, "{:.2f}"),
    ("block limit: registers", "launch__occupancy_limit_registers", 1, "{:.0f}"),
    ("block limit: shared memory", "launch__occupancy_limit_shared_mem", 1, "{:.0f}"),
    ("Warp state", None, None, None),
    ("warp cycles per issued instruction", "smsp__average_warp_latency_per_inst_issued.ratio", 1, "{:.3f}"),
]

STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def _ratio(a, b, floor: float = 0.0) -> str:
    """a / b, blank when either is missing or b is at or under ``floor`` (a ratio of near-zeros says nothing)."""
    return f"{a / b:.2f}" if a is not None and b is not None and b > floor else ""


def opcode_counts(metrics: dict) -> dict[str, float]:
    """Executed warp-level SASS instructions per opcode (instances of sass__inst_executed_per_opcode)."""
    entry = metrics.get("sass__inst_executed_per_opcode", {})
    if entry.get("ambiguous"):
        return {}
    return {i["key"]: i["value"] for i in entry.get("instances", [])
            if isinstance(i.get("key"), str) and isinstance(i.get("value"), (int, float))}


def _cell(metrics: dict, name: str, scale: float, fmt: str) -> str:
    entry = metrics.get(name)
    if entry is None:
        return "-"
    if entry.get("ambiguous") or entry["type"] not in ("double", "uint64"):
        return "?"
    return fmt.format(entry["value"] * scale)


def table(reports: list[tuple[str, dict]], top_opcodes: int = 16) -> str:
    labels = [label for label, _ in reports]
    kms = [rep["kernels"][0]["metrics"] for _, rep in reports]
    width = 58
    col = max(12, *(len(lab) for lab in labels))
    lines = []

    def row(label, cells):
        lines.append(f"{label:<{width}}" + "".join(f"{c:>{col + 2}}" for c in cells))

    for label, rep in reports:
        k = rep["kernels"][0]
        lines.append(f"{label}: {k['name']}")
    row("", labels + (["ratio"] if len(kms) == 2 else []))
    for label, metric, scale, fmt in ROWS:
        if metric is None:
            lines.append(f"-- {label}")
            continue
        if all(metric not in m for m in kms):
            continue
        cells = [_cell(m, metric, scale, fmt) for m in kms]
        if len(kms) == 2:
            cells.append(_ratio(*(_num(m, metric) for m in kms)))
        row(label, cells)
    stalls = sorted(
        {k for m in kms for k in m if k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX)},
        key=lambda k: -(_num(kms[0], k) or 0.0),
    )
    lines.append(f"-- Warp stalls (warps stalled per issued instruction, {STALL_PREFIX}<reason>{STALL_SUFFIX}),"
                 f" sorted by {labels[0]}")
    for name in stalls:
        values = [_num(m, name) for m in kms]
        if all(v is not None and v < 0.005 for v in values):
            continue
        cells = [_cell(m, name, 1, "{:.3f}") for m in kms]
        if len(kms) == 2:
            cells.append(_ratio(*values, floor=0.005))
        row("  " + name[len(STALL_PREFIX) : -len(STALL_SUFFIX)], cells)
    lines.append("  (reasons under 0.005 in every report left out; 'selected' is the issuing warp itself, 1 per"
                 " instruction)")
    ops = [opcode_counts(m) for m in kms]
    if all(ops):
        top = {k for o in ops for k in sorted(o, key=o.get, reverse=True)[:top_opcodes]}
        top |= {k for o in ops for k in o if k.endswith("MMA")}  # every tensor-core opcode
        top = sorted(top, key=lambda k: (-ops[0].get(k, 0.0), -ops[-1].get(k, 0.0)))
        lines.append(f"-- Executed SASS instructions per opcode (millions of warp instructions,"
                     f" sass__inst_executed_per_opcode), top {top_opcodes} of each and every *MMA, sorted by {labels[0]}")
        for op in top:
            values = [o.get(op, 0.0) for o in ops]
            cells = [f"{v / 1e6:.1f}" for v in values]
            if len(kms) == 2:
                cells.append(_ratio(*values, floor=1e6))
            row("  " + op, cells)
        row("  all opcodes", [f"{sum(o.values()) / 1e6:.1f}" for o in ops]
            + ([_ratio(*(sum(o.values()) for o in ops))] if len(kms) == 2 else []))
    return "\n".join(lines)


def dump(buf: bytes, indent: int = 0, out=sys.stdout, depth: int = 12) -> None:
    """Print the message tree of ``buf`` (sub-messages expanded where they parse)."""
    for field, wire, value in parse_message(buf):
        pad = "  " * indent
        if wire == WIRE_LEN:
            sub = looks_like_submessage(value) if depth else None
            if sub is not None:
                print(f"{pad}{field}: {{  # {len(value)} bytes", file=out)
                dump(value, indent + 1, out, depth - 1)
                print(f"{pad}}}", file=out)
            else:
                print(f"{pad}{field}: {value[:100]!r}{'...' if len(value) > 100 else ''}", file=out)
        elif wire == WIRE_I64:
            print(f"{pad}{field}: fixed64 double={struct.unpack('<d', value)[0]!r} "
                  f"uint64={struct.unpack('<Q', value)[0]}", file=out)
        elif wire == WIRE_I32:
            print(f"{pad}{field}: fixed32 float={struct.unpack('<f', value)[0]!r} "
                  f"uint32={struct.unpack('<I', value)[0]}", file=out)
        else:
            print(f"{pad}{field}: {value}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="*", help="LABEL=PATH.ncu-rep (or PATH; the label is the file stem)")
    parser.add_argument("--json", metavar="OUT", help="write every recovered metric of every report here")
    parser.add_argument("--dump", metavar="REPORT", help="print the raw record/message tree of one report")
    args = parser.parse_args(argv)
    if args.dump:
        data = Path(args.dump).read_bytes()
        offset, records = split_records(data)
        print(f"# header {data[:offset]!r}, {len(records)} records")
        for n, rec in enumerate(records):
            print(f"# record {n}: {len(rec)} bytes")
            dump(rec)
        return 0
    if not args.reports:
        parser.error("give at least one report")
    reports = []
    for spec in args.reports:
        label, _, path = spec.rpartition("=")
        reports.append((label or Path(path).stem, read_report(path)))
    failed = False
    for label, rep in reports:
        if len(rep["kernels"]) != 1:
            print(f"{label}: {len(rep['kernels'])} kernel results in {rep['file']} (the table shows the first)")
        for k in rep["kernels"]:
            checks = sanity_checks(k["metrics"])
            bad = [c for c in checks if not c[1]]
            ambiguous = sum(1 for v in k["metrics"].values() if v.get("ambiguous"))
            print(f"{label}: {len(k['metrics'])} metrics ({ambiguous} of ambiguous type), "
                  f"sanity checks {len(checks) - len(bad)}/{len(checks)} passed"
                  + "".join(f"\n  FAILED {c[0]}: {c[2]}" for c in bad))
            failed |= bool(bad)
    if args.json:
        payload = {
            label: {
                "file": rep["file"],
                "header_offset": rep["header_offset"],
                "kernels": [{"name": k["name"], "metrics": {n: {kk: _json_safe(vv) for kk, vv in v.items()}
                                                            for n, v in sorted(k["metrics"].items())}}
                            for k in rep["kernels"]],
                "named_outside_results": {n: {kk: _json_safe(vv) for kk, vv in v.items()}
                                          for n, v in sorted(rep["named"].items())},
            }
            for label, rep in reports
        }
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")
    if failed:
        print("sanity checks failed: the decoded layout does not hold for these files; no table printed")
        return 1
    if all(rep["kernels"] for _, rep in reports):
        print()
        print(table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
