"""Host memory is part of the fit: where the host cannot hold every offloaded layer input, the fit splits them
over the GPU, host memory and a file, and says so; a host too small for any split is one line; a host with
room keeps the configuration the fit chose before there were tiers."""

from __future__ import annotations

from pathlib import Path

import pytest

from neutrain.cli import main as neutrain
from neutrain.config import load_recipe
from neutrain.errors import RecipeError
from neutrain.memory import GIB, FIT_HEADROOM, choose_fit, estimate_recipe
from neutrain.memory.planner import ACTIVATION_STAGING_BYTES
from neutrain.memory.shape import recipe_shape
from neutrain.memory.step_time import DISK_BYTES_PER_S, GPU, step_time
from neutrain.memory.tiers import HOST_PROCESS_BYTES, split
from neutrain.nn.activation_file import STAGING_BYTES
from tests.helpers import one_error_line

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "llama3_70b_offload.yaml"
BUDGET = 22 * GIB


def _70b():
    return load_recipe(RECIPE, ["memory.device_budget_gib=22"])


def test_the_70b_at_22_gib_fits_a_100_gib_host_with_its_layer_inputs_split():
    fit = choose_fit(_70b(), BUDGET, 100 * GIB)
    tiers = fit.tiers
    assert tiers is not None and tiers.layers == 80 and tiers.device > 0 and tiers.file > 0
    # Both limits held: the device budget with the fit's headroom, the host with the process's own room.
    assert fit.peak[1].reserved <= BUDGET * (1 - FIT_HEADROOM)
    assert fit.host_need <= 100 * GIB and fit.host_bytes <= 92 * GIB
    assert f"layer inputs: {tiers.device} on the GPU, {tiers.host} in host memory, {tiers.file} in a file under " \
           "outputs/llama3_70b_offload/.cache" in fit.line
    assert "the host's 100.00 GiB cannot hold every layer input" in fit.line
    p = fit.placement  # what the trainer acts on
    assert p.offload_activations and (p.activation_device_layers, p.activation_file_layers) == (tiers.device, tiers.file)
    assert fit.as_dict()["activation_tiers"] == {"device": tiers.device, "host": tiers.host, "file": tiers.file}


def test_estimate_shows_the_tiers(capsys, monkeypatch):
    monkeypatch.setenv("NEUTRAIN_HOST_MEMORY_GIB", "100")
    assert neutrain(["estimate", str(RECIPE), "memory.device_budget_gib=22"]) == 0
    out = capsys.readouterr().out
    assert "in a file under outputs/llama3_70b_offload/.cache)  <- chosen" in out
    t = choose_fit(_70b(), BUDGET, 100 * GIB).tiers
    assert (f"checkpointed layer inputs (0.25 GiB each): {t.device} on the GPU, {t.host} in host memory, {t.file} in a "
            f"file under outputs/llama3_70b_offload/.cache ({t.file / 4:.2f} GiB written and read back each step)") in out


def test_a_host_too_small_for_any_split_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.setenv("NEUTRAIN_HOST_MEMORY_GIB", "60")
    rc = neutrain(["estimate", str(RECIPE), "memory.device_budget_gib=22"])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "Traceback" not in line
    assert "nothing fits a budget of 22.00 GiB with 60.00 GiB of host memory available" in line
    assert "need at least" in line and "for the process itself" in line


def test_a_large_host_keeps_the_choice_without_tiers():
    roomy, unknown = choose_fit(_70b(), BUDGET, 128 * GIB), choose_fit(_70b(), BUDGET, None)
    assert roomy.tiers is None and roomy.label == "offloading weights and activations"
    assert roomy.changes == unknown.changes == {"memory.offload_activations": True}
    assert roomy.line == unknown.line and round(roomy.host_bytes / GIB, 2) == 108.43
    assert roomy.placement.activation_file_layers == roomy.placement.activation_device_layers == 0


def test_the_split_takes_the_fastest_tiers_first():
    # The GPU holds what its room holds, then the host, then a file with a staging buffer beside the host's part.
    assert (split(80, GIB, 10 * GIB, 100 * GIB).device, split(80, GIB, 10 * GIB, 100 * GIB).file) == (10, 0)
    t = split(80, 0.25 * GIB, 3.9 * GIB, 3.5 * GIB)
    assert (t.device, t.host, t.file) == (15, 13, 52)
    with pytest.raises(RecipeError):
        # the pinned weights alone do not fit (the fewest, 70 layers streamed beside 2 slots and a chunked MLP)
        choose_fit(_70b(), BUDGET, int(HOST_PROCESS_BYTES + 70 * GIB))


def test_the_step_time_charges_the_file_at_the_disk_rate():
    recipe = _70b().changed(memory={"offload_activations": True})
    shape = recipe_shape(recipe)
    host = step_time(estimate_recipe(recipe, shape), shape, GPU)
    spilled = estimate_recipe(recipe, shape, activation_file_layers=40)
    filed = step_time(spilled, shape, GPU)
    assert host.disk_s == 0 and filed.disk_s == pytest.approx(2 * spilled.settings["file_activation_bytes"] / DISK_BYTES_PER_S)
    assert filed.link_s == pytest.approx(host.link_s)  # the same bytes cross PCIe, whichever host tier holds them
    assert filed.step_s > host.step_s


def test_the_planner_counts_the_staging_buffer_the_file_pins():
    assert ACTIVATION_STAGING_BYTES == STAGING_BYTES


def test_the_host_check_before_the_fit_leaves_the_layer_inputs_to_it_under_a_budget():
    from neutrain.cli.preflight import check_host_memory

    asked = load_recipe(RECIPE, ["memory.device_budget_gib=22", "memory.offload_activations=true"])
    check_host_memory(asked, available=100 * GIB)  # the fit splits the inputs (as for the recipe as shipped)
    assert choose_fit(asked, BUDGET, 100 * GIB).tiers is not None
    with pytest.raises(RecipeError, match=r"memory\.offload_weights: needs about 88\.4 GiB of host memory for the "
                                          r"compressed decoder weights"):
        check_host_memory(asked, available=80 * GIB)  # the weights alone do not fit
