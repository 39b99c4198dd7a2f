"""Hostile cases of the one-config-per-method split, block / cost sparsity, the measure registry, the
timm fold rules and the recipes' restore of a save killed between its renames: each was a defect a
"break it" review found (now fixed); each test states its truth."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import linearize
from linearize import schedules as S

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))

import common  # noqa: E402


def test_group_penalty_gradient_is_finite_at_a_linear_site():
    """Truth: ``||1 - a||_2`` has a subgradient of 0 where the gap is 0 (torch.linalg.norm backward gives
    0 there, as the penalty's earlier ``gap.norm()`` did). With ``granularity="site"`` and
    ``mode="loss"``, a site whose slopes all reached 1 must not give NaN slope gradients. Observed: all
    NaN; in the documented loop (``target(0.5, end=10)``, ``mode="loss"``, ``granularity="site"``, SGD,
    loss + penalty) the first site the projection snaps to 1 turns NaN and step 1 raises
    ``NonFiniteSlopeError: ... Training diverged``."""
    torch.manual_seed(0)
    model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
    sp = linearize.Sparsifier(model, S.constant(0.1), total_steps=10, mode="loss", granularity="site")
    first, second = (u for _, u in linearize.units(model))
    with torch.no_grad():
        first.slope.fill_(1.0)  # this site is exactly linear (its channels are free, not frozen)
    sp.penalty().backward()
    assert torch.isfinite(second.slope.grad).all()
    assert torch.isfinite(first.slope.grad).all()  # observed: all NaN


def test_replace_mode_takes_the_new_modes_default_beta():
    """Truth (GatedConfig docs): ``beta=None`` takes the mode's default, 4 for DGN and 10 for DLGN; a
    config built as DGN with no beta given, switched to DLGN with ``replace``, must equal
    ``LinearizeConfig(mode="dlgn")`` (beta 10). Observed: beta 4.0 carried over (it was filled in
    ``__post_init__``, not given by the user)."""
    switched = linearize.LinearizeConfig(mode="dgn").replace(mode="dlgn")
    assert switched.beta == linearize.LinearizeConfig(mode="dlgn").beta == 10.0


def test_save_of_one_folder_keeps_the_aside_copy_of_a_sibling(tmp_path, dead_pid):
    """Truth (replaced_dir docs: "never a lost folder"): a save of ``model`` killed between its renames
    leaves ``.tmp-model-best-old-<pid>`` for the sibling ``model-best``; writing the *other* folder
    ``model`` must not delete it, and ``restore_aside(model-best)`` must bring it back. Observed: the
    leftover glob ``.tmp-model-*`` of ``model`` matches and removes it, so ``model-best`` is lost."""
    aside = tmp_path / f"{common.TMP_PREFIX}model-best-old-{dead_pid}"
    aside.mkdir()
    (aside / "recipe.json").write_text('{"v": 1}')
    with common.replaced_dir(tmp_path / "model") as stage:
        (stage / "recipe.json").write_text('{"v": 2}')
    assert common.read_recipe_json(tmp_path / "model-best") == {"v": 1}


def test_restore_aside_never_restores_another_folders_copy(tmp_path, dead_pid):
    """Truth: ``restore_aside(dir)`` puts back ``dir``'s own aside copy (``.tmp-<dir>-old-<pid>``) only.
    With ``model`` missing and only ``.tmp-model-old-old-7`` present (the aside copy of the sibling
    folder ``model-old``), nothing must be restored into ``model``. Observed: the glob
    ``.tmp-model-old-*`` matches it, and ``model-old``'s content becomes ``model``."""
    other = tmp_path / f"{common.TMP_PREFIX}model-old-old-{dead_pid}"
    other.mkdir()
    assert common.restore_aside(tmp_path / "model") is None
    assert other.exists()


def test_register_measure_refuses_a_plot_file_outside_the_report_folder(tmp_path):
    """Truth: ``Report.save(out_dir)`` writes every plot into ``out_dir``; a measure's ``plot_file`` is
    "a file name" (register_measure docs), so ``"../escape.png"`` or an absolute path must be refused
    with a ValueError at registration. Observed: accepted, and ``save`` would write it outside."""
    from linearize.report_measures import MEASURES, register_measure

    try:
        with pytest.raises(ValueError):
            register_measure("hostile_escape", lambda ctx: 1.0, plot=lambda v: b"png",
                             plot_file=str(tmp_path / ".." / "escape.png"))
    finally:
        MEASURES.pop("hostile_escape", None)


def test_subclass_from_dict_of_another_modes_dict_names_the_right_fix():
    """Truth: ``from_dict`` reads ``d["mode"]``; ``BlendConfig.from_dict`` of a DGN dict must either
    return that mode's config or say the dict is of mode 'dgn' and point at ``LinearizeConfig.from_dict``.
    Observed: "'beta' is an option of mode 'dgn'/'dlgn' (GatedConfig), not of mode 'dgn' (BlendConfig)"
    (the config names the wrong class for its own mode, and the suggested fix, convert with mode='dgn',
    is what the dict already says)."""
    from linearize.config import BlendConfig, GatedConfig

    d = GatedConfig(mode="dgn").to_dict()
    try:
        cfg = BlendConfig.from_dict(d)
    except (TypeError, ValueError) as err:
        assert "not of mode 'dgn'" not in str(err)
        assert "LinearizeConfig.from_dict" in str(err)
    else:
        assert cfg == GatedConfig(mode="dgn")


def test_gated_bool_options_refuse_strings():
    """Truth: ``hard_gates`` and ``freeze_feature`` are booleans. A hand-edited or crafted config dict with
    ``"hard_gates": "false"`` must be refused (TypeError/ValueError naming the option), not read as the
    truthy string, which turns hard gates *on*. Observed: accepted, ``cfg.hard_gates == "false"``."""
    with pytest.raises((TypeError, ValueError), match="hard_gates"):
        linearize.LinearizeConfig.from_dict({"mode": "dgn", "hard_gates": "false"})


def test_resume_with_latency_weights_is_exact():
    """Truth (Sparsifier resume contract): a Sparsifier rebuilt the same way and given ``state_dict()``
    continues exactly as the uninterrupted one. With ``weights="latency"`` the per-unit weights are
    timings measured in ``__init__`` and not saved, so the rebuilt Sparsifier pushes each site by a
    different (noisy) amount: the slopes after one more step differ."""
    import copy
    import warnings

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    model = linearize.convert(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8), nn.ReLU(),
                                            nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2)), example_inputs=x)

    def build(m):
        return linearize.Sparsifier(m, S.constant(), total_steps=10, weights="latency", example_inputs=x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no optimizer: the slopes move by the pressure alone
        sp = build(model)
        sp.step()
        model2 = copy.deepcopy(model)
        sp2 = build(model2)
        sp2.load_state_dict(sp.state_dict())
        sp.step()
        sp2.step()
    for (_, a), (_, b) in zip(linearize.units(model), linearize.units(model2)):
        assert torch.equal(a.slope, b.slope)


def test_report_refuses_a_non_finite_measure_value_by_name():
    """Truth: ``report()`` checks every measure value against what ``report.json`` can hold (``_checked``)
    and names the measure otherwise; ``report.json`` is written with ``allow_nan=False``. A measure
    returning NaN must therefore either be refused by ``report()`` naming the measure, or be written.
    Observed: ``report()`` accepts NaN (its check uses ``json.dumps`` with NaN allowed) and
    ``to_json()`` / ``save()`` then raise a bare "Out of range float values" naming nothing."""
    from linearize.report_measures import MEASURES, register_measure

    register_measure("hostile_nan", lambda ctx: {"score": float("nan")})
    try:
        model = linearize.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                                  example_inputs=torch.randn(2, 4))
        skip = [k for k in MEASURES if k not in ("hostile_nan", "units")]
        try:
            rep = linearize.report(model, torch.randn(8, 4), skip=skip, progress=False)
        except (TypeError, ValueError) as err:
            assert "hostile_nan" in str(err)
        else:
            rep.to_json()
    finally:
        MEASURES.pop("hostile_nan", None)


def test_fold_of_a_timm_condconv_block_equals_its_source():
    """Truth: fold returns a model computing the source's function (or leaves a block it cannot fold as
    it is). timm's ``CondConvResidual`` subclasses ``InvertedResidual`` but its forward computes
    routing weights and calls ``conv_pw(x, routing_weights)``; the timm inverted-residual rule matches it
    by ``isinstance`` and lays its layers out as a plain chain. Observed: ``TypeError: CondConv2d.forward()
    missing 1 required positional argument: 'routing_weights'`` from deep inside torch."""
    timm_blocks = pytest.importorskip("timm.models._efficientnet_blocks")
    torch.manual_seed(0)
    block = timm_blocks.CondConvResidual(8, 8, exp_ratio=2.0, num_experts=2)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), block, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)).eval()
    x = torch.randn(2, 3, 6, 6)
    model = linearize.convert(model, example_inputs=x)
    folded = linearize.fold(model, x, latency=False)
    with torch.no_grad():
        ref = model(x)
        assert (folded(x) - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_load_state_dict_checks_the_cost_plan():
    """Truth (load_state_dict docs: "Everything is checked before anything changes"): a state whose cost
    plan names a group this Sparsifier does not have (``plan: [7]`` with 2 sites), or whose
    ``plan_costs`` do not match the plan, must be refused with a ValueError at load. Observed: accepted;
    the next ``step()`` raises a bare ``IndexError: list index out of range`` (or ``StopIteration``
    for a short ``plan_costs``)."""
    import json
    import warnings

    torch.manual_seed(0)
    x = torch.randn(4, 16)

    def build():
        model = linearize.convert(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                                nn.Linear(32, 4)), example_inputs=x)
        return linearize.Sparsifier(model, S.target(flops=0.6, end=4), total_steps=8, granularity="site",
                                    example_inputs=x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sp = build()
        sp.step()
        state = json.loads(json.dumps(sp.state_dict()))
        assert state["plan"] is not None  # the plan was made at the target's start
        for bad in ({"plan": [7], "plan_costs": [1.0, 0.5]}, {"plan": [0], "plan_costs": [1.0]}):
            with pytest.raises(ValueError):
                build().load_state_dict({**state, **bad})


def test_register_measure_refuses_non_callable_parts():
    """Truth (register_measure docs): a measure is a ``compute(ctx)`` function, its ``plot`` a function
    ``plot(value) -> bytes``; a function given bare is checked (``TypeError``), so a ``Measure`` whose
    ``compute`` is ``5`` or whose ``plot`` is a string must be refused too. Observed: both registered;
    the report fails later, after the measures before it ran, with "'int' object is not callable"."""
    from linearize.report_measures import MEASURES, Measure, register_measure

    try:
        with pytest.raises(TypeError):
            register_measure("hostile_compute", Measure(compute=5))
        with pytest.raises(TypeError):
            register_measure("hostile_plot", lambda ctx: 1.0, plot="fraction.png")
    finally:
        MEASURES.pop("hostile_compute", None)
        MEASURES.pop("hostile_plot", None)
