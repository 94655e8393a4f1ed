"""Peak memory a phase (build, save, resume, export) allocates beyond what it started with.

No phase may hold a second copy of the model; its scratch must stay near one matrix.
:func:`host_peak` counts the CPU allocator through torch's profiler (``profile_memory``: every
allocation and free of the c10 CPU allocator, in order), so a tiny model on the CPU plays the
device; :func:`cuda_peak` reads the CUDA allocator's own peak.
"""

import torch
from torch.profiler import ProfilerActivity, profile

# Odd sizes that no tensor of a phase allocates: two marker allocations bound the phase in the event list.
_START, _END = 104_729, 104_723


def _mark(nbytes: int) -> None:
    torch.empty(nbytes, dtype=torch.uint8)


def host_peak(setup, phase, ignore_sizes=()):
    """``(result, peak)``: bytes the CPU allocator held at most during ``phase(setup())`` beyond what it
    held when ``phase`` started (``setup`` runs under the profiler too, so frees of what it built count).

    ``ignore_sizes``: allocation sizes to leave out, with their frees: safetensors maps a file it reads as
    one storage of the file's size, which is the page cache, not memory the phase allocates.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        obj = setup()
        _mark(_START)
        result = phase(obj)
        _mark(_END)
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    start = next(i for i, e in enumerate(events) if e.self_cpu_memory_usage == _START)
    end = next(i for i, e in enumerate(events) if i > start and e.self_cpu_memory_usage == _END)
    live = peak = 0
    for event in events[start + 2:end]:  # after the start marker's allocation and free
        if abs(event.self_cpu_memory_usage) in ignore_sizes:
            continue
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return result, peak


def cuda_peak(phase, *args):
    """``(result, peak)``: CUDA bytes allocated at most during ``phase(*args)`` beyond those allocated before."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = phase(*args)
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - before


def largest_matrix_bytes(model) -> int:
    """Dense bytes of the model's largest weight matrix (compressed ones by their shape and dtype)."""
    from neutrain.nn import compressed_weights

    sizes = [w.shape.numel() * w.dtype.itemsize for w in compressed_weights(model)]
    sizes += [p.numel() * p.element_size() for p in model.parameters() if p.dim() >= 2 and not p.is_meta]
    return max(sizes)
