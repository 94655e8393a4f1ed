"""Every command with a standard stream closed or failing: the exit status says what it would have said, no file
of the command's takes a standard descriptor's number, and a closed stdin is an empty one.

``neutrain train RECIPE 2>&-`` gave the run's ``.neutrain.lock`` descriptor 2 (the first file opened takes the
lowest free number), so native libraries' warnings were written into the lock; a bad recipe with ``2>&-``,
``2> /dev/full`` or a stderr pipe whose reader had gone exited 1, an environment failure, instead of 2 (the refusal
itself could not be written, and that raised); ``chat MODEL <&-`` was an ``AttributeError`` traceback.

Each case runs ``neutrain.cli.main`` in a forked child of this process (its streams closed or redirected as the
shell would, the command modules imported already), so a case costs a fork, not an interpreter start.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import stat
import sys
import traceback

import pytest

from neutrain.cli.main import COMMANDS

# A target that does not exist: every command but `recipes` refuses it as bad input, exit 2.
ARGV = {
    "train": (["train", "{missing}/r.yaml"], 2),
    "eval": (["eval", "{missing}/checkpoint-2"], 2),
    "export": (["export", "{missing}/checkpoint-2", "--format", "hf"], 2),
    "estimate": (["estimate", "{missing}/r.yaml"], 2),
    "distill": (["distill", "{missing}/r.yaml"], 2),
    "generate": (["generate", "{missing}/model", "--prompt", "x"], 2),
    "chat": (["chat", "{missing}/model"], 2),
    "recipes": (["recipes"], 0),
}

# How the shell leaves each stream: closed (`<&-`, `>&-`, `2>&-`), a pipe whose reader has gone, a full device.
STATES = {
    "stdin closed": {0: "closed"},
    "stdout closed": {1: "closed"},
    "stderr closed": {2: "closed"},
    "all closed": {0: "closed", 1: "closed", 2: "closed"},
    "stderr reader gone": {2: "reader gone"},
    "stderr full": {2: "/dev/full"},
    "stderr a non-blocking pipe, full": {2: "full pipe"},  # its reader is there but reads nothing
}
NAMES = {0: "stdin", 1: "stdout", 2: "stderr"}


def _set_streams(state: dict[int, str]) -> None:
    """Make this (child) process's descriptors and ``sys`` streams what a fresh interpreter would have had."""
    for fd, how in state.items():
        if how == "closed":
            os.close(fd)
        elif how == "reader gone":
            read, write = os.pipe()
            os.close(read)
            os.dup2(write, fd)
            os.close(write)
        elif how == "full pipe":  # the read end stays open, unread, for the child's life
            read, write = os.pipe()
            os.set_blocking(write, False)
            with contextlib.suppress(BlockingIOError):
                while True:
                    os.write(write, b"x" * 65536)
            os.dup2(write, fd)
            os.set_blocking(fd, False)
            os.close(write)
        else:
            full = os.open(how, os.O_WRONLY)
            os.dup2(full, fd)
            os.close(full)
    for fd, name in NAMES.items():  # as Python sets them at start: None over a closed descriptor
        stream = None
        if state.get(fd) != "closed":
            stream = open(fd, "r" if fd == 0 else "w", closefd=False, errors="backslashreplace",
                          buffering=1 if fd == 2 else -1)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _is_null(fd: int) -> bool:
    try:
        info = os.fstat(fd)
    except OSError:
        return False
    null = os.stat(os.devnull)
    return stat.S_ISCHR(info.st_mode) and info.st_rdev == null.st_rdev


def _run_in_child(argv: list[str], state: dict[int, str]) -> dict:
    """``main(argv)`` in a forked child with ``state``'s streams: its exit code, which standard descriptors are
    ``/dev/null`` after it, or the traceback it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        report = {}
        try:
            os.close(read)
            import torch

            torch.set_num_threads(1)  # a forked child runs no thread pool its parent started
            import neutrain.cli.stdout

            neutrain.cli.stdout.STDERR_WAIT_S = 0.05  # a full pipe's wait, shortened: nobody reads this one
            _set_streams(state)
            from neutrain.cli.main import main

            report["code"] = main(argv)
            report["null"] = [fd for fd in NAMES if _is_null(fd)]
        except BaseException:  # noqa: BLE001 - reported to the parent, whatever it is
            report["raised"] = traceback.format_exc()
        os.write(write, json.dumps(report).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    # A child stuck (a lock another thread of this process held at the fork) fails its case, never the session.
    while True:
        if not select.select([read], [], [], 120)[0]:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"{argv} with {state}: the forked child did not end within 120 s")
        if not (chunk := os.read(read, 65536)):
            break
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b"{}")


@pytest.fixture(scope="module", autouse=True)
def _commands_imported(tmp_path_factory):
    """Each command run here once on its missing target, so that every module it imports lazily is imported
    before the forks: no child spends a second importing transformers' model code."""
    from neutrain.cli.main import main

    missing = tmp_path_factory.mktemp("warm") / "missing"
    for argv, _ in ARGV.values():
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main([a.format(missing=missing) for a in argv])


def test_the_table_names_every_command():
    assert set(ARGV) == set(COMMANDS)


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("command", list(ARGV))
def test_a_closed_or_failing_standard_stream_changes_no_exit_status_and_lends_no_descriptor(tmp_path, command, state):
    argv, code = ARGV[command]
    report = _run_in_child([a.format(missing=tmp_path / "missing") for a in argv], STATES[state])
    assert "raised" not in report, report.get("raised")
    assert report["code"] == code, report
    closed = [fd for fd, how in STATES[state].items() if how == "closed"]
    assert set(closed) <= set(report["null"]), f"a closed descriptor was left for a file to take: {report}"


def test_chat_with_stdin_closed_is_an_empty_conversation(tiny_run):
    report = _run_in_child(["chat", str(tiny_run / "export")], {0: "closed"})
    assert "raised" not in report, report.get("raised")
    assert report["code"] == 0 and 0 in report["null"], report



def test_a_full_non_blocking_stdout_is_waited_for_never_dropped():
    """A non-blocking stdout pipe that is full when the command prints (its reader behind) waits for the reader, as
    a blocking one does: the whole output, exit 0 (it was dropped in silence, exit 0)."""
    argv, expected = ["recipes"], "default "
    read, write = os.pipe()
    os.set_blocking(write, False)
    filler = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            filler += os.write(write, b"x" * 4096)
    status, report = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = -1
        try:
            os.close(read)
            os.close(status)
            os.dup2(write, 1)
            os.close(write)
            sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
            from neutrain.cli.main import main

            code = main(argv)
        finally:
            os.write(report, str(code).encode())
            os._exit(0)
    os.close(write)
    os.close(report)
    # The reader stays behind for a moment (the child prints into the full pipe meanwhile), then catches up. A
    # command that waits for it finishes either way; the moment only lets one that drops its output be caught.
    select.select([status], [], [], 0.5)
    drained = b""
    while chunk := os.read(read, 65536):  # the reader catches up: EOF once the child has exited
        drained += chunk
    os.close(read)
    os.waitpid(pid, 0)
    code = os.read(status, 64)
    os.close(status)
    assert code == b"0" and expected in drained[filler:].decode(), (code, drained[filler:filler + 300])
