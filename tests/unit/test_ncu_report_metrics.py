"""The schema-less Nsight Compute report reader on hand-built protobuf bytes laid out like a ``.ncu-rep``.

No report file is needed: the bytes are written here field by field (magic, uint32-length-prefixed records,
a string-table header, a result whose metrics are ``{1: name index, 2: value, 3: instance*, 4: 0}``).
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "attention" / "ncu_report_metrics.py"
_spec = importlib.util.spec_from_file_location("ncu_report_metrics", _PATH)
ncu = importlib.util.module_from_spec(_spec)
sys.modules["ncu_report_metrics"] = ncu
_spec.loader.exec_module(ncu)


# ------------------------------------------------------------------------------ protobuf writer


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def f_varint(field: int, n: int) -> bytes:
    return varint(field << 3 | 0) + varint(n)


def f_len(field: int, payload: bytes | str) -> bytes:
    if isinstance(payload, str):
        payload = payload.encode()
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def f_double(field: int, x: float) -> bytes:
    return varint(field << 3 | 1) + struct.pack("<d", x)


def f_float(field: int, x: float) -> bytes:
    return varint(field << 3 | 5) + struct.pack("<f", x)


def value(v) -> bytes:
    """A value message as found: 1 = string, 3 = double, 5 = uint64."""
    if isinstance(v, str):
        return f_len(1, v)
    if isinstance(v, float):
        return f_double(3, v)
    return f_varint(5, v)


def entry(index: int, v, instances=()) -> bytes:
    """A metric; ``v`` None leaves the value out (the reports have such entries: no value collected)."""
    body = f_varint(1, index) + (f_len(2, value(v)) if v is not None else b"")
    for key, iv in instances:
        body += f_len(3, f_len(1, value(key)) + f_len(2, value(iv)))
    return body + f_varint(4, 0)


def record(msg: bytes) -> bytes:
    return struct.pack("<I", len(msg)) + msg


def report_bytes(metrics: dict, kernel: str = "my_kernel") -> bytes:
    """Magic, a version record, a string-table header, the result, then a device-attribute record."""
    names = list(metrics)
    table = b"".join(f_len(1, n) for n in names)
    result = f_varint(1, 4321) + f_len(5, kernel) + f_len(6, kernel)
    for i, n in enumerate(names):
        v = metrics[n]
        if isinstance(v, tuple):  # (value, instances)
            result += f_len(13, entry(i, v[0], v[1]))
        else:
            result += f_len(13, entry(i, v))
    header = f_varint(1, 0) + f_varint(2, 1) + f_len(4, table) + f_varint(5, len(result) + 4)
    device = f_varint(1, 0) + f_len(3, f_len(6, f_varint(1, 0) + f_len(2, "Test GPU") + f_len(
        3, f_len(1, "device__attribute_fbp_count") + f_len(2, value(12)))))
    return b"NVR\x00" + record(f_varint(1, 7)) + record(header) + record(result) + record(device)


def good_metrics(duration_ns: float = 30e6, tensor_pct: float = 45.0, kernel: str = "my_kernel") -> dict:
    clock = 1.8e9
    stalls = {"barrier": 2.5, "selected": 1.0, "wait": 0.5}
    m = {
        "launch__grid_size": 256, "launch__grid_dim_x": 128, "launch__grid_dim_y": 2, "launch__grid_dim_z": 1,
        "launch__block_size": 384, "launch__block_dim_x": 384, "launch__block_dim_y": 1, "launch__block_dim_z": 1,
        "launch__sm_count": 132, "device__attribute_multiprocessor_count": 132,
        "launch__waves_per_multiprocessor": 256 / 132, "launch__registers_per_thread": 168,
        "launch__shared_mem_per_block": 116000, "launch__kernel_name": ("", [(0, kernel)]),
        "gpu__time_duration.sum": duration_ns, "gpc__cycles_elapsed.max": duration_ns * 1e-9 * clock,
        "gpc__cycles_elapsed.avg.per_second": clock,
        "sm__throughput.avg.pct_of_peak_sustained_elapsed": 46.0,
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed": tensor_pct,
        "smsp__average_warp_latency_per_inst_issued.ratio": sum(stalls.values()),
        "inst_executed": 1000,
        "sass__inst_executed_register_spilling_mem_local": None,
        "sass__inst_executed_per_opcode": (1000.0, [("FFMA", 600.0), ("IGMMA", 400.0)]),
    }
    for reason, r in stalls.items():
        m[f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"] = r
    return m


# ------------------------------------------------------------------------------------------ tests


def test_wire_parser_round_trip():
    msg = f_varint(1, 300) + f_len(2, "abc") + f_double(3, 2.5) + f_float(4, 1.5)
    fields = ncu.parse_message(msg)
    assert [(f, w) for f, w, _ in fields] == [(1, 0), (2, 2), (3, 1), (4, 5)]
    assert fields[0][2] == 300 and fields[1][2] == b"abc"
    assert struct.unpack("<d", fields[2][2])[0] == 2.5
    with pytest.raises(ncu.WireError):
        ncu.parse_message(f_len(2, "abc")[:-1])  # runs past the end


def test_value_types_and_ambiguity():
    assert ncu.decode_value(value("x")) == {"type": "string", "value": "x"}
    assert ncu.decode_value(value(2.25)) == {"type": "double", "value": 2.25}
    assert ncu.decode_value(value(384)) == {"type": "uint64", "value": 384}
    odd = ncu.decode_value(f_float(2, 1.5))
    assert odd["ambiguous"] and odd["type"] == "fixed32?" and odd["value"] == 1.5
    assert ncu.decode_value(f_double(7, 1.0))["ambiguous"]
    assert ncu.decode_value(value(1) + value(2)) is None  # two fields: not a value


def test_split_records_finds_the_header():
    data = report_bytes(good_metrics())
    offset, records = ncu.split_records(data)
    assert offset == 4 and len(records) == 4
    assert ncu.parse_message(records[0]) == [(1, 0, 7)]


def test_read_report_recovers_names_and_values(tmp_path):
    metrics = good_metrics()
    path = tmp_path / "k.ncu-rep"
    path.write_bytes(report_bytes(metrics))
    rep = ncu.read_report(path)
    assert len(rep["kernels"]) == 1
    k = rep["kernels"][0]
    assert k["name"] == "my_kernel"
    got = k["metrics"]
    assert got["launch__block_size"] == {"type": "uint64", "value": 384}
    assert got["launch__registers_per_thread"]["value"] == 168
    assert got["gpu__time_duration.sum"] == {"type": "double", "value": 30e6}
    assert got["launch__waves_per_multiprocessor"]["value"] == pytest.approx(256 / 132)
    assert ncu.opcode_counts(got) == {"FFMA": 600.0, "IGMMA": 400.0}
    assert got["sass__inst_executed_register_spilling_mem_local"] == {"type": "none", "value": None}
    assert set(got) == set(metrics)
    assert rep["named"] == {"device__attribute_fbp_count": {"type": "uint64", "value": 12}}
    assert all(ok for _, ok, _ in ncu.sanity_checks(got))


def test_sanity_checks_catch_a_wrong_layout():
    m = good_metrics()
    m["launch__block_size"] = 383  # not the product of the block dims
    m["gpu__time_duration.sum"] = 1.0  # not cycles / clock
    path_bytes = report_bytes(m)
    offset, records = ncu.split_records(path_bytes)
    table = ncu.find_string_table(records[1])
    assert table[:2] == ["launch__grid_size", "launch__grid_dim_x"]
    metrics = {table[i]: ncu._value_entry(v, inst)
               for i, v, inst in (ncu.indexed_entry(raw) for f, w, raw in ncu.parse_message(records[2]) if f == 13)}
    failed = {label for label, ok, _ in ncu.sanity_checks(metrics) if not ok}
    assert "block_size = block_dim_x*y*z" in failed
    assert "gpu__time_duration.sum (ns) = gpc cycles / clock" in failed


def test_main_prints_the_side_by_side_table_and_json(tmp_path, capsys):
    a, b = tmp_path / "a.ncu-rep", tmp_path / "b.ncu-rep"
    a.write_bytes(report_bytes(good_metrics(30e6, 45.0, "kernel_a")))
    b.write_bytes(report_bytes(good_metrics(25e6, 78.0, "kernel_b")))
    out_json = tmp_path / "all.json"
    assert ncu.main([f"one={a}", f"two={b}", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "sanity checks 8/8 passed" in text
    duration = next(line for line in text.splitlines() if line.startswith("duration (ms)"))
    assert duration.split()[-3:] == ["30.000", "25.000", "1.20"]
    tensor = next(line for line in text.splitlines() if line.startswith("tensor pipe active"))
    assert tensor.split()[-3:] == ["45.0", "78.0", "0.58"]
    stall_lines = [line.split()[0] for line in text.splitlines() if line.startswith("  ") and
                   line.split()[0] in ("barrier", "selected", "wait")]
    assert stall_lines == ["barrier", "selected", "wait"]  # largest first
    saved = json.loads(out_json.read_text())
    assert saved["two"]["kernels"][0]["metrics"]["launch__block_size"]["value"] == 384
    assert saved["one"]["kernels"][0]["name"] == "kernel_a"


def test_main_refuses_the_table_when_checks_fail(tmp_path, capsys):
    m = good_metrics()
    m["launch__registers_per_thread"] = 0
    path = tmp_path / "bad.ncu-rep"
    path.write_bytes(report_bytes(m))
    assert ncu.main([str(path)]) == 1
    text = capsys.readouterr().out
    assert "FAILED registers_per_thread in 1..255" in text and "no table printed" in text
