"""``neutrain estimate``: predict a recipe's peak GPU memory from its model config, loading no weights.

It prints the training step's terms, then each phase's predicted peak (build, training step,
evaluation, sample, save, resume, export: :mod:`neutrain.memory.phase_planner`), then the device
budget and the configuration the run would choose for it (:mod:`neutrain.memory.fit`).
"""

from __future__ import annotations

from neutrain.compat.deepspeed_env import no_gpu_device_nodes
from neutrain.config import load_recipe
from neutrain.errors import RecipeError


def configure(p) -> None:
    """The ``estimate`` command's description and arguments, on its subparser ``p``."""
    p.description = ("Predict peak GPU memory, phase by phase, from the model config and the recipe (no "
                     "weights are loaded), and the configuration the run picks for memory.device_budget_gib.")
    p.add_argument("recipe", help="recipe YAML file or shipped recipe name")
    p.add_argument("overrides", nargs="*", help="dotted overrides")


def _card_total(recipe) -> int | None:
    """This machine's GPU memory in bytes (what ``memory.device_budget_gib: auto`` resolves against), or None.

    torch is imported only where a GPU may be there: on a host without GPU device files an estimate
    stays arithmetic on the config.
    """
    if recipe.train.use_cpu or recipe.memory.device_budget_gib != "auto" or no_gpu_device_nodes():
        return None
    import torch  # lazy: only a host that may have a GPU asks torch for it

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def run(args) -> int:
    """Print the planner's predicted peak memory, term by term and phase by phase, and the automatic fit."""
    from neutrain.cli.memory import check_step_time  # lazy: `neutrain --help` stays instant
    from neutrain.cli.preflight import host_memory_available  # lazy: `neutrain --help` stays instant
    # lazy: `neutrain --help` stays instant
    from neutrain.memory import GIB, choose_fit, estimate_recipe, plan_recipe, plan_table, resolve_budget

    recipe = load_recipe(args.recipe, args.overrides, shape_only=True)  # no transformers where the shape is given
    setting = recipe.memory.device_budget_gib
    card = _card_total(recipe)
    budget = resolve_budget(setting, card)
    host = host_memory_available()
    gpu = card is not None or budget is not None  # a budget plans for a GPU, wherever this runs
    fit = choose_fit(recipe, budget, host, gpu=gpu, card=card)  # nothing fits: one line, exit 2
    asked = recipe.changed(memory={"weights": fit.weights}) if recipe.memory.weights == "auto" else recipe
    est = estimate_recipe(asked)
    st = est.settings
    auto = " (memory.weights: auto)" if asked is not recipe else ""
    print(f"{recipe.source}: {parameter_count(st['params'])} parameters, batch {st['batch']} x {st['seq']} tokens, "
          f"weights {st['weights']}{auto}, optimizer {recipe.train.optimizer}, checkpointing {st['checkpointing']}")
    print(est.table())
    print("\npredicted peak by phase (GiB)")
    print(plan_table(plan_recipe(asked, est)))
    if budget is None:
        why = "none" if setting == "none" else "auto, and this machine has no GPU to resolve it against"
        print(f"\nbudget: {why} (memory.device_budget_gib); " + (
            "only the weights are chosen" if auto else "the recipe's configuration as it is"))
    else:
        print(f"\nbudget: {budget / GIB:.2f} GiB (memory.device_budget_gib: {setting}"
              + (f", a {card / GIB:.2f} GiB card" if setting == "auto" else "") + ")")
    print(configurations_table(fit, gpu))
    print(fit.line)
    try:
        check_step_time(recipe, fit, gpu)
    except RecipeError as refused:
        print(f"neutrain train refuses it here: {refused}")
    if set(fit.changes) - {"memory.weights"}:
        print("chosen configuration: " + ", ".join(f"{k}={v}" for k, v in fit.changes.items() if k))
        chosen = fit.plan["train_step"].settings
        if chosen.get("offload_weights"):
            print(f"decoder layers in host memory: {chosen['offloaded_layers']} of {chosen['layers']} "
                  f"({', '.join(map(str, chosen['offloaded']))}), {chosen['offload_slots']} on the GPU at once; "
                  f"PCIe a step: {chosen['h2d_bytes_per_step'] / GIB:.2f} GiB in, {chosen['d2h_bytes_per_step'] / GIB:.2f} GiB out")
        if fit.tiers:  # the host could not hold every offloaded layer input: where each layer's waits
            t, each = fit.tiers, chosen["layer_input_bytes"] / GIB
            print(f"checkpointed layer inputs ({each:.2f} GiB each): {t.device} on the GPU, {t.host} in host memory, "
                  f"{t.file} in a file under {recipe.train.output_dir.rstrip('/')}/.cache "
                  f"({chosen['file_activation_bytes'] / GIB:.2f} GiB written and read back each step)")
        print(plan_table(fit.plan))
    return 0


def configurations_table(fit, gpu: bool) -> str:
    """Every configuration family the fit tried (its fastest member that fits, else its smallest): predicted
    peak reserved and host memory (GiB), predicted tokens/s, whether it fits, and which was chosen.

    Example:
        >>> from neutrain.config import load_recipe
        >>> from neutrain.memory import choose_fit
        >>> print(configurations_table(choose_fit(load_recipe("llama3_8b"), 22 * 2**30, 64 * 2**30), True))
        ... # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        configurations (tok/s predicted on an H200, fastest first)
          reserved      host     tok/s  fits  configuration
             16.78      0.00     3,114  yes   dense weights on the GPU  <- chosen
             16.55      0.25     3,094  yes   dense weights, offloading activations
        ...
    """
    from neutrain.memory import rate  # lazy: `neutrain --help` stays instant

    lines = [f"\nconfigurations (tok/s predicted on {'an H200' if gpu else 'this CPU'}, fastest first)",
             f"  {'reserved':>8}{'host':>10}{'tok/s':>10}  fits  configuration"]
    for row in fit.tried:
        lines.append(f"  {row['predicted_reserved_gib']:>8.2f}{row['host_gib']:>10.2f}{rate(row['predicted_tokens_per_s']):>10}"
                     f"  {'yes' if row['fits'] else 'no':<4}  {row['choice']}" + ("  <- chosen" if row["chosen"] else ""))
    return "\n".join(lines)


def parameter_count(n: int) -> str:
    """A parameter count as people write it: ``4.19M``, ``135M``, ``8.03B`` (a tiny model read "0.00B").

    Example:
        >>> parameter_count(4_194_304), parameter_count(134_515_008), parameter_count(8_030_261_248), parameter_count(950)
        ('4.19M', '135M', '8.03B', '950')
    """
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return str(n)
