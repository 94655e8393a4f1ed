"""SIGTERM and SIGINT during training: save a checkpoint at the next step boundary, then stop.

Why: schedulers (SLURM, Kubernetes) send SIGTERM some seconds before they kill a job, and a
user stops a run with Ctrl-C. Python's default SIGTERM ends the process at once, and the steps
since the last ``save_steps`` checkpoint were lost. With :class:`StopOnSignal` installed around
``trainer.train``:

* the first SIGTERM or SIGINT is noted; at the end of the step under way the Trainer saves
  ``checkpoint-<step>`` (atomically, as every checkpoint) and the training loop stops; the
  caller then raises :class:`StoppedBySignal`, which the CLI prints as one line and exits
  ``128 + signal`` (143 for SIGTERM, 130 for SIGINT), as a process killed by that signal would;
* if the step boundary is not reached within ``grace_s`` seconds (a step can be long), the
  process exits anyway, saying that nothing was saved: the scheduler's own kill would come soon;
* a second SIGINT stops at once (``KeyboardInterrupt``), for a user who does not want to wait.

Several processes (``accelerate launch``) agree at each step boundary on whether any of them
was signalled, so they all save the same step and stop together.

Example:
    >>> import signal
    >>> stopper = StopOnSignal(grace_s=30)
    >>> with stopper.installed():
    ...     stopper.handle(signal.SIGTERM, None)  # what the OS does on `kill <pid>`
    ...     stopper.signal_name
    'SIGTERM'
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Callable

from transformers import TrainerCallback

from neutrain.config.knobs import KNOBS, knob
from neutrain.errors import StoppedBySignal, print_error

__all__ = ["SignalDuringPhase", "StopOnSignal", "StoppedBySignal", "follow_launcher", "grace_seconds", "stopping_at_once"]

logger = logging.getLogger("neutrain")

HANDLED = (signal.SIGTERM, signal.SIGINT)
DEFAULT_GRACE_S = KNOBS["NEUTRAIN_STOP_GRACE_S"].default
"""Seconds from the signal to the step boundary before the process gives up saving (``NEUTRAIN_STOP_GRACE_S``).
Two minutes: a scheduler's grace period (Kubernetes 30 s by default, SLURM ``KillWait`` 30 s, often raised for
training jobs) is what really bounds it; this bound only keeps a hung step from holding the job forever."""


def grace_seconds() -> float:
    """``NEUTRAIN_STOP_GRACE_S`` or :data:`DEFAULT_GRACE_S` (a value that is not a number of seconds > 0 and at
    most a week, which a timer can wait, is refused in one line: neutrain.config.knobs)."""
    return knob("NEUTRAIN_STOP_GRACE_S")


def _give_up(message: str, signum: int) -> None:
    """The watchdog's end: one line, then exit without running Python's shutdown (a step may hold locks)."""
    print_error(message)
    os._exit(128 + int(signum))


class StopOnSignal(TrainerCallback):
    """A Trainer callback that turns SIGTERM/SIGINT into "save at the next step boundary, then stop".

    Args:
        grace_s: seconds allowed from the signal to the step boundary (default :func:`grace_seconds`).
        on_expire: called with (message, signal number) when ``grace_s`` passes first; by default the
            process prints the message and exits 128 + signal.
    """

    def __init__(self, grace_s: float | None = None, on_expire: Callable[[str, int], None] = _give_up):
        self.grace_s = grace_seconds() if grace_s is None else grace_s
        self.on_expire = on_expire
        self.signum: int | None = None
        self.stopped_at: int | None = None  # the step whose checkpoint was asked for
        self._timer: threading.Timer | None = None
        self._group = None  # the process group the per-step flag travels on (on_train_begin)

    @property
    def signal_name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    def handle(self, signum, frame) -> None:
        """The signal handler (runs in the main thread, between two bytecodes of the training loop)."""
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # the second Ctrl-C: stop now
            return  # a repeated SIGTERM: the save is already on its way
        self.signum = signum
        logger.info("%s received: saving a checkpoint at the end of this step, then stopping (at most %g s; "
                    "Ctrl-C again stops at once)", self.signal_name, self.grace_s)
        message = (f"{self.signal_name} received, but the step under way did not end within {self.grace_s:g} s "
                   f"(NEUTRAIN_STOP_GRACE_S): stopped without saving; the last checkpoint is the latest saved")
        self._timer = threading.Timer(self.grace_s, self.on_expire, args=(message, signum))
        self._timer.daemon = True
        self._timer.start()

    @contextlib.contextmanager
    def installed(self):
        """Handle SIGTERM and SIGINT inside the block; the previous handlers come back after it.

        Outside the main thread (signal handlers cannot be set there) the block runs unguarded.
        """
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self.handle) for s in HANDLED}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.cancel_watchdog()

    def cancel_watchdog(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def on_train_begin(self, args, state, control, **kwargs):
        import torch.distributed as dist

        if args.world_size > 1 and dist.is_available() and dist.is_initialized():
            # The flag goes over gloo, on the host: over NCCL, reading it back would wait for the GPU every step.
            self._group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        return control

    def _any_process_signalled(self, args) -> bool:
        """Whether this process or any other of the launch got a signal (one tiny host all-reduce a step)."""
        flag = self.signum is not None
        if self._group is None:
            return flag
        import torch
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        if t.item() > 0 and self.signum is None:
            self.signum = signal.SIGTERM  # another process was signalled: stop with it, at the same step
        return t.item() > 0

    def on_step_end(self, args, state, control, **kwargs):
        if self.stopped_at is None and self._any_process_signalled(args):
            self.cancel_watchdog()  # the boundary is reached: the save below is atomic, a kill during it is safe
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
        return control

    def stop_message(self, output_dir: str) -> str:
        """The one line the CLI prints after the checkpoint was saved."""
        if self.stopped_at is None:  # the signal came after the last step: its checkpoint is saved already
            return (f"stopped by {self.signal_name} after the last training step (its checkpoint is saved); "
                    "relaunch with train.resume_from_checkpoint=true to run evaluation, export and the summary")
        checkpoint = os.path.join(output_dir, f"checkpoint-{self.stopped_at}")
        return (f"stopped by {self.signal_name} at step {self.stopped_at}: saved {checkpoint}; "
                f"continue with train.resume_from_checkpoint=true")


class SignalDuringPhase(BaseException):
    """SIGTERM or SIGINT arrived during a phase that :func:`stopping_at_once` guards.

    A ``BaseException``, as ``KeyboardInterrupt`` is: no ``except Exception`` on the way may take it for an
    error of its own and carry on.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = int(signum)
        self.name = signal.Signals(self.signum).name


@contextlib.contextmanager
def stopping_at_once():
    """Inside the block, SIGTERM and SIGINT raise :class:`SignalDuringPhase` at once; the previous handlers
    come back after it.

    For the phases after training (evaluation, export, the summary): they keep nothing half-done (an export is
    staged and renamed), so stopping them at once loses no work, and a relaunch runs them again. Python's
    default SIGTERM ended the process without a word, leaving the run's lock and an export temporary to
    the next start. Outside the main thread the block runs unguarded.

    Example:
        >>> import os
        >>> try:
        ...     with stopping_at_once():
        ...         os.kill(os.getpid(), signal.SIGTERM)
        ... except SignalDuringPhase as stop:
        ...     stop.name
        'SIGTERM'
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum, frame):
        raise SignalDuringPhase(signum)

    previous = {s: signal.signal(s, handle) for s in HANDLED}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# How launchers appear in their own command line: a module run with -m, or a console script's name.
_LAUNCHER_MODULES = ("accelerate.commands.launch", "torch.distributed.run", "torch.distributed.launch")
_LAUNCHER_SCRIPTS = ("torchrun", "accelerate-launch")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def is_launcher(argv: list[str]) -> bool:
    """Whether a process with command line ``argv`` is ``accelerate launch`` or ``torchrun``.

    Example:
        >>> is_launcher(["/usr/bin/python3", "/usr/local/bin/accelerate", "launch", "-m", "neutrain", "r.yaml"])
        True
        >>> is_launcher(["bash", "-c", "neutrain train r.yaml"])
        False
    """
    head = argv[:4]
    names = [os.path.basename(a) for a in head]
    return (any(a in _LAUNCHER_MODULES for a in head) or any(n in _LAUNCHER_SCRIPTS for n in names)
            or ("accelerate" in names and "launch" in head))


def follow_launcher() -> bool:
    """When a launcher started this process, have the kernel send it SIGTERM once the launcher dies; returns
    whether it did.

    Why: SIGTERM to ``accelerate launch`` (what a scheduler preempting the job sends to the process it
    started) ended only the launcher; the trainer it had started was orphaned, kept the run's lock,
    trained to the end and never saved at the signal. With the parent-death signal set, the trainer gets
    SIGTERM too and saves at the next step boundary (:class:`StopOnSignal`). Only under a launcher: a run
    started from a shell must outlive that shell (``nohup``). Linux only (``prctl``); elsewhere a no-op.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as fh:
            argv = [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return False
    if not is_launcher(argv):
        return False
    import ctypes  # lazy: only under a launcher

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        logger.warning("could not ask to be signalled when the launcher ends (errno %d)", ctypes.get_errno())
        return False
    if os.getppid() != parent:  # the launcher died before the request was made: as if signalled now
        os.kill(os.getpid(), signal.SIGTERM)
    return True
