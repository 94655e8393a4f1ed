"""Checks a run makes before the model is built, so a bad setting cannot waste the training time.

Why a separate step: some recipe values are only consumed after training (the
long-context tasks, the export), and some only make sense with what the launch
gives (the number of processes) or what the disk allows (``output_dir``). Each
of these used to fail after the model was built, often after the whole run.
:func:`preflight` checks them all first; :func:`~neutrain.cli.train.build_trainer`
calls it right after the process state exists.

Errors: a bad setting is a :class:`~neutrain.errors.RecipeError` (exit 2);
an output directory that cannot be written is an ``OSError`` naming the key and
the path (exit 1: the environment, not the recipe, is at fault).
"""

from __future__ import annotations

import difflib
import errno
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from neutrain.errors import RecipeError, UserInputError
from neutrain.files import link_trouble, nearest_existing
from neutrain.config.knobs import knob
from neutrain.config.schema import Recipe
from neutrain.distributed.arguments import distributed_request
from neutrain.cli.outputs import check_output_places
from neutrain.export.target import check_export_target
from neutrain.files import read_json_object
from neutrain.trainer.disk_plan import check_path_lengths

if TYPE_CHECKING:  # annotations only: the classes are not needed at run time
    from neutrain.config.sections import MemorySection, TrainSection
    from neutrain.config.after_training_sections import EvalSection


def check_long_context_prompts(tokenizer, eval_cfg: EvalSection) -> None:
    """Generate the long-context prompts now, with the run's tokenizer (milliseconds a task).

    Why: a prompt that cannot fit ``eval.context_len`` in this tokenizer's tokens (the default 512
    is too short for most tasks under the byte tokenizer) used to fail after training.
    """
    from neutrain.eval.tasks import generate_task  # lazy: `neutrain --help` stays instant

    for name in eval_cfg.long_context_tasks:
        try:
            generate_task(name, tokenizer, eval_cfg.context_len, eval_cfg.num_samples)
        except ValueError as exc:
            raise RecipeError(f"eval.context_len: {eval_cfg.context_len} tokens is too short for long-context task "
                              f"'{name}' with this tokenizer ({exc})") from None


def check_sample_prompt(model, tokenizer, eval_cfg: EvalSection, chat: bool) -> None:
    """``eval.sample_prompt`` and ``eval.sample_tokens`` fit the built model's context, checked before the first step.

    Why: the sample is generated after all the training; a prompt past the model's positions decoded positions the
    model never learnt and printed an empty sample, exit 0, and an empty one failed in the decoder's prefill.
    """
    if eval_cfg.sample_prompt is None:
        return
    from neutrain.data.chat import prompt_ids, template_choice  # lazy: `neutrain --help` stays instant

    use_template, _ = template_choice(tokenizer, chat)
    tokens = len(prompt_ids(tokenizer, eval_cfg.sample_prompt, raw=not use_template))
    if tokens == 0:
        raise RecipeError("eval.sample_prompt: the prompt is empty (0 tokens after the tokenizer); give some text, "
                          "or leave the key out for no sample")
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(context, int) or isinstance(context, bool):
        return
    if tokens >= context:
        raise RecipeError(f"eval.sample_prompt: the prompt alone has {tokens:,} tokens, and the model's context is "
                          f"{context:,} positions (max_position_embeddings); shorten it to fewer than {context:,} tokens")
    if tokens + eval_cfg.sample_tokens > context:
        raise RecipeError(f"eval.sample_tokens: {eval_cfg.sample_tokens:,} new tokens after the {tokens:,}-token "
                          f"eval.sample_prompt exceed the model's context of {context:,} positions "
                          f"(max_position_embeddings); set it to at most {context - tokens:,}")


def check_report_to(report_to: str | list) -> None:
    """``train.report_to`` names loggers transformers knows and that are installed (else the Trainer fails later)."""
    try:
        from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations
    except ImportError:  # another transformers layout: its own check runs when the Trainer is built
        return
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    for name in names:
        if name in ("none", "all") or name is None:
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            match = difflib.get_close_matches(str(name), list(INTEGRATION_TO_CALLBACK), n=1)
            hint = f" Did you mean '{match[0]}'?" if match else ""
            raise RecipeError(f"train.report_to: unknown logger {name!r}.{hint} Loggers are: none, all, {', '.join(INTEGRATION_TO_CALLBACK)}")
        if name not in get_available_reporting_integrations():
            raise RecipeError(f"train.report_to: {name!r} is not installed in this environment (install it, or set train.report_to: none)")


def _json_file(key: str, path: str) -> dict:
    # The one reader: the kind before it is opened (a FIFO hung here, /dev/zero ran out of memory), a size
    # bound, the encoding, and a parse error with its line and column.
    return read_json_object(path, f"{key}: file '{path}'", RecipeError)


def check_distributed(train: TrainSection, num_processes: int) -> None:
    """The ``train`` section's distributed settings, given the processes this launch started."""
    if isinstance(train.fsdp_config, str):
        _json_file("train.fsdp_config", train.fsdp_config)
    if train.deepspeed:
        _json_file("train.deepspeed", train.deepspeed)
    distributed_request(train).check_processes(num_processes)  # raises on contradicting keys first


def accumulation_note(rows: int | None, micro_batch: int, accumulation: int, processes: int = 1) -> str | None:
    """The warning for ``train.gradient_accumulation_steps`` past the micro-batches one epoch has, else None.

    Why: an optimizer step accumulates at most the micro-batches left in the epoch, so accumulating 8 (or
    1000) over a 3-row epoch trained exactly as accumulating 3, and the recipe's number said otherwise.

    Example:
        >>> accumulation_note(3, 1, 8)
        'train.gradient_accumulation_steps: 8 micro-batches per optimizer step, but an epoch has only 3 (3 rows at train.micro_batch_size 1 on 1 process(es)): each step accumulates at most the epoch, so the run trains as with 3'
        >>> accumulation_note(100, 4, 8) is None
        True
    """
    if not rows:
        return None
    per_epoch = -(-rows // (micro_batch * processes))
    if accumulation <= per_epoch:
        return None
    return (f"train.gradient_accumulation_steps: {accumulation} micro-batches per optimizer step, but an epoch has only "
            f"{per_epoch} ({rows} rows at train.micro_batch_size {micro_batch} on {processes} process(es)): each step "
            f"accumulates at most the epoch, so the run trains as with {per_epoch}")


def check_launch(num_processes: int, cuda_available: bool, environ: Mapping[str, str] = os.environ) -> None:
    """Every process the launcher started joined this run (``WORLD_SIZE`` of them), else none trains.

    Why: ``accelerate launch --config_file launch/multi_gpu_ddp.yaml`` (or ``fsdp2.yaml``) on a machine
    without GPUs starts two processes, and Accelerate, finding no GPU for the configuration, leaves each
    on its own: both believed they were the main process, and the run-directory lock then blamed the
    launch's own second process ("in use by another neutrain run").

    Example:
        >>> check_launch(2, cuda_available=False, environ={"WORLD_SIZE": "2"})
        >>> try:
        ...     check_launch(1, cuda_available=False, environ={"WORLD_SIZE": "2"})
        ... except UserInputError as e:
        ...     print(str(e)[:62])
        the launch started 2 processes, but each runs alone: this mach
    """
    try:
        world = int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world <= num_processes:
        return
    if not cuda_available:
        refusal = UserInputError(
            f"the launch started {world} processes, but each runs alone: this machine has no GPU for the launch "
            "configuration's GPU processes. On a CPU, train in one process (`neutrain <recipe>`), or in "
            f"{world} CPU processes (`torchrun --nproc_per_node {world} -m neutrain <recipe>`)")
        refusal.main_rank_only = True  # every process finds it: the launch's first one says it
        raise refusal
    raise UserInputError(f"the launch started {world} processes (WORLD_SIZE), but this one sees a run of "
                         f"{num_processes}: the processes disagree on the launch. Check the launch configuration "
                         "(num_processes, distributed_type) and that every process sees its GPU")


def cpu_processes(environ: Mapping[str, str], cuda_available: bool) -> bool:
    """True for processes a plain launcher (``torchrun``) started on a machine without GPUs: they train together
    on the CPU (gloo), as ``train.use_cpu: true`` makes them.

    Why: the README's ``torchrun --nproc_per_node 2 -m neutrain recipes/default.yaml`` was refused ("each runs
    alone"): Accelerate joins launched processes on the CPU only when told to use it, and the shipped recipes
    do not say so. An ``accelerate launch`` of a GPU configuration (Accelerate's variables set) is still
    refused by :func:`check_launch`: it asked for GPUs.

    Example:
        >>> cpu_processes({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, cuda_available=False)
        True
        >>> cpu_processes({"WORLD_SIZE": "2", "LOCAL_RANK": "0", "ACCELERATE_MIXED_PRECISION": "no"}, cuda_available=False)
        False
    """
    try:
        world = int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    accelerate = any(name.startswith("ACCELERATE_") for name in environ)
    return world > 1 and "LOCAL_RANK" in environ and not cuda_available and not accelerate


def check_weight_offload_device(memory: MemorySection, use_cpu: bool, cuda_available: bool) -> None:
    """``memory.offload_weights`` needs a GPU to offload from: refused for a run on the CPU.

    Why: on a CPU every weight already lives in host memory; the run accepted the key, streamed the
    layers from one part of host memory to another and reported "0.00 GiB in host memory".

    Example:
        >>> from neutrain.config.sections import MemorySection
        >>> check_weight_offload_device(MemorySection(), use_cpu=True, cuda_available=False)
        >>> try:
        ...     check_weight_offload_device(MemorySection(offload_weights=True), use_cpu=False, cuda_available=False)
        ... except RecipeError as e:
        ...     print(str(e)[:48])
        memory.offload_weights: true moves the decoder l
    """
    if not memory.offload_weights or (cuda_available and not use_cpu):
        return
    where = "train.use_cpu is true" if use_cpu else "this machine has no GPU"
    raise RecipeError(f"memory.offload_weights: true moves the decoder layers' weights from GPU memory to host "
                      f"memory, and this run trains on the CPU ({where}), where every weight is in host memory "
                      "already: it would save nothing. Remove the setting (or set it to false)")


_PROBE = ".neutrain-write-probe-"


def check_writable_dir(path: str, key: str) -> None:
    """Create ``path`` if needed and prove a file can be written there (then remove the probe).

    Raises:
        OSError: with ``filename`` set and a note naming ``key``; ``main`` prints it as one line, exit 1.

    Example:
        >>> check_writable_dir(tempfile.gettempdir(), "train.output_dir")
    """
    p = Path(path)
    if trouble := link_trouble(p):
        raise RecipeError(f"{key}: '{path}' {trouble}")
    try:
        if p.exists() and not p.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", str(p))
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=_PROBE, dir=p)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        if exc.filename and Path(exc.filename).name.startswith(_PROBE):  # name the directory, not our probe file
            exc = OSError(exc.errno, exc.strerror, str(p))
        exc.add_note(f"{key} is not writable")
        raise exc from None


def host_memory_available() -> int | None:
    """Bytes of host memory available now (``MemAvailable`` of ``/proc/meminfo``), or None where unknown.

    ``NEUTRAIN_HOST_MEMORY_GIB`` replaces the reading. Why: a virtual machine whose memory is plugged in as it
    is used (Firecracker, virtio-mem) reports a fraction of its limit at first, so the 70B's 105 GiB plan was
    refused on a host allowed 256 GiB.
    """
    stated = knob("NEUTRAIN_HOST_MEMORY_GIB")
    if stated is not None:
        return int(stated * (1 << 30))
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_memory_for(processes: int) -> int | None:
    """Host bytes one of ``processes`` may plan with: what is available now, alone; with several processes on
    the host, its total over their count, which every process reads alike (each one's own reading of what is
    available could resolve ``memory.weights: auto`` otherwise on another rank)."""
    stated = knob("NEUTRAIN_HOST_MEMORY_GIB")
    if processes <= 1 or stated is not None:
        available = host_memory_available()
        return available if processes <= 1 or available is None else available // processes
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 // processes
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(recipe: Recipe, available: int | None) -> None:
    """``memory.offload_weights`` / ``offload_activations`` need host memory the planner can predict.

    Why: the 70B's decoder layers take about 87 GiB of pinned host memory, filled layer by layer while
    the model is built. On a host with less, the build would be killed (or fail to pin) minutes in;
    refused here it costs nothing. Only a certain failure is refused (need above what is available).

    Example:
        >>> from neutrain.config import load_recipe
        >>> r = load_recipe("recipes/llama3_70b_offload.yaml")
        >>> check_host_memory(r, available=128 << 30)
        >>> try:
        ...     check_host_memory(r, available=64 << 30)
        ... except RecipeError as e:
        ...     print(str(e)[:59])
        memory.offload_weights: needs about 88.4 GiB of host memory
    """
    mem = recipe.memory
    if available is None or not (mem.offload_weights or mem.offload_activations):
        return
    from neutrain.memory import GIB, estimate_recipe  # lazy: torch-free checks stay fast

    if mem.weights == "auto":  # the host bytes are the activations', and offloaded weights are NeuZip's
        recipe = recipe.changed(memory={"weights": "neuzip-lossless" if mem.offload_weights else "dense"})
    try:
        settings = estimate_recipe(recipe).settings
    except (OSError, ValueError, KeyError, TypeError):
        return  # the model config cannot be read without building: the build names what is wrong
    weights = settings.get("host_pinned_bytes", 0)  # the payload and its arenas' room (the planner's)
    activations = settings.get("host_activation_bytes", 0)
    if isinstance(mem.device_budget_gib, float) and activations:
        # A budget set in GiB plans for a GPU: the fit keeps on the device, or spills to a file, the layer inputs
        # the host cannot hold (neutrain.memory.tiers), and refuses in its own line if even that cannot fit.
        activations = 0
    need = weights + activations
    if need <= available:
        return
    key = "memory.offload_weights" if weights else "memory.offload_activations"
    if weights and activations:
        what = (f"({weights / GIB:.1f} GiB of compressed decoder weights and {activations / GIB:.1f} GiB of "
                "checkpointed activations)")
    else:
        what = "for the compressed decoder weights" if weights else "for the checkpointed activations"
    raise RecipeError(f"{key}: needs about {need / GIB:.1f} GiB of host memory {what}, but this "
                      f"machine has {available / GIB:.1f} GiB available; use a host with more memory, or a smaller "
                      "model, data.sequence_len or train.micro_batch_size")


MAX_LAYERS = 4096
"""Decoder layers a model may have: the deepest published decoders have under 200, and building a
million tiny ones took longer than any test of patience (it hung)."""


def _cuda_available() -> bool:
    import torch  # lazy: `neutrain --help` stays instant

    return torch.cuda.is_available()


def device_memory_total() -> int | None:
    """Bytes of memory of the GPU this process trains on, or None without CUDA."""
    import torch  # lazy: `neutrain --help` stays instant

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def _dense_bits(dtype: str, on_cpu: bool) -> int:
    """Bits a dense weight takes as built: ``auto`` on a CPU is fp32 only without native bf16 units
    (the choice ``resolve_dtype`` makes); counting 32 there over-counted bf16 CPUs twice."""
    if dtype == "float32":
        return 32
    if dtype == "auto" and on_cpu:
        from neutrain.compat.cpu_features import native_bf16_feature  # lazy: reads /proc/cpuinfo once

        return 16 if native_bf16_feature() else 32
    return 16


def check_model_size(recipe: Recipe, host_bytes: int | None, device_bytes: int | None) -> None:
    """Refuse a model whose weights alone cannot fit the memory they are built in, before anything is built.

    Why: ``model.config`` with ``hidden_size`` or ``vocab_size`` of 1e9 failed in the allocator with a
    traceback, and ``num_hidden_layers: 1000000`` hung while building. The parameter count comes from the
    planner's `neutrain.memory.ModelShape` (its counts are closed-form, so a depth of a
    million layers costs nothing), times the bytes a weight takes as built (dtype, or NeuZip's bits).
    Only a certain failure is refused: the weights alone, without gradients, optimizer or activations.

    Args:
        recipe: A validated recipe.
        host_bytes: Host memory available (the weights of a CPU run, or offloaded ones, live there); None: unknown.
        device_bytes: Memory of the GPU a GPU run trains on; None: a CPU run or unknown.

    Example:
        >>> from neutrain.config import load_recipe
        >>> r = load_recipe("default", ["model.dtype=float32"])
        >>> check_model_size(r, host_bytes=64 << 30, device_bytes=None)
        >>> try:
        ...     check_model_size(r, host_bytes=1 << 20, device_bytes=None)
        ... except RecipeError as e:
        ...     print(str(e)[:40])
        model.config: the weights alone need abo
    """
    from neutrain.memory import GIB, NEUZIP_BITS, recipe_shape  # lazy: torch-free checks stay fast

    try:
        shape = recipe_shape(recipe)
    except (OSError, ImportError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError):
        return  # the config cannot be read without building: the build names what is wrong
    if shape.layers > MAX_LAYERS:
        raise RecipeError(f"model.config.num_hidden_layers: {shape.layers:,} layers is beyond neutrain's bound of "
                          f"{MAX_LAYERS:,} (the deepest published decoders have under 200)")
    params = shape.params()
    mem = recipe.memory
    on_cpu = recipe.train.use_cpu or device_bytes is None
    bits = NEUZIP_BITS if mem.weights != "dense" else _dense_bits(recipe.model.dtype, on_cpu)
    need = params * bits / 8
    where, have = ("host", host_bytes) if on_cpu or mem.offload_weights else ("GPU", device_bytes)
    if have is None or need <= have:
        return
    raise RecipeError(f"model.config: the weights alone need about {need / GIB:,.1f} GiB ({params:,} parameters: "
                      f"hidden_size {shape.hidden:,}, num_hidden_layers {shape.layers:,}, vocab_size {shape.vocab:,}), "
                      f"but this machine has {have / GIB:,.1f} GiB of {where} memory {'available' if where == 'host' else ''}"
                      .rstrip() + "; use a smaller model.config")


def check_machine_holds(recipe: Recipe) -> None:
    """Refuse ``recipe`` where this machine cannot hold what it keeps in memory: the host bytes its offload
    needs first (the more specific line names the offload key), then the weights themselves."""
    host = host_memory_available()
    check_host_memory(recipe, host)
    check_model_size(recipe, host, None if recipe.train.use_cpu else device_memory_total())


def check_export_place(recipe: Recipe) -> None:
    """Refuse an export directory the run may not write: one that is not a neutrain export, or that is or holds
    ``train.output_dir``. Refused before training, not after it: an export may only replace its own kind."""
    if recipe.export.format != "none":
        check_export_target(recipe.export_dir, overwrite=True, key="export.output_dir",
                            keep=(("train.output_dir", recipe.train.output_dir),))


def preflight(recipe: Recipe, num_processes: int = 1) -> None:
    """Check what would otherwise fail only after the model is built or after training.

    Args:
        recipe: A validated recipe.
        num_processes: Processes of this launch (``PartialState().num_processes``).

    Example:
        >>> import tempfile
        >>> from neutrain.config import load_recipe
        >>> out = tempfile.mkdtemp()
        >>> preflight(load_recipe("default", [f"train.output_dir={out}"]), num_processes=1)
    """
    check_launch(num_processes, _cuda_available())
    check_distributed(recipe.train, num_processes)
    check_report_to(recipe.train.report_to)
    out = recipe.train.output_dir
    if not Path(nearest_existing(out)).is_dir():
        check_writable_dir(out, "train.output_dir")  # a file stands in the way: raises, having created nothing
    target = recipe.export.output_dir
    if recipe.export.format != "none" and target:
        existing = Path(nearest_existing(target))
        if not existing.is_dir():
            exc = NotADirectoryError(errno.ENOTDIR, "a file stands where a directory is needed", str(existing))
            exc.add_note("export.output_dir is not writable")
            raise exc
        if not os.access(existing, os.W_OK):
            exc = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(existing))
            exc.add_note("export.output_dir is not writable")
            raise exc
    check_output_places(recipe)  # no output inside another run's checkpoint or export
    check_export_place(recipe)
    check_path_lengths(recipe, num_processes)  # every folder's longest planned path fits the file system
    check_machine_holds(recipe)
    # Last: it creates train.output_dir, which must not happen for a run refused above.
    check_writable_dir(out, "train.output_dir")
