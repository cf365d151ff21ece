"""The held-out evaluation's parts (PREREGISTERED.md): the nine fault shapes, their assignment, the GRU setting, the
branching at each shape's start, and the pre-registered analysis on records whose outcomes are known."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from tests.benchmarks import benchmark_module

faults = benchmark_module("faults", "rescue")
engine = benchmark_module("engine", "rescue")
heldout = benchmark_module("heldout", "rescue")


def test_every_setting_gets_every_shape_by_seed_position(faults):
    for setting, seeds in faults.HELDOUT_SEEDS.items():
        setups = [faults.heldout_setup(i) for i in range(len(seeds))]
        assert {s.transient_shape for s in setups} == set(faults.TRANSIENT_SHAPES), setting
        assert {s.structural_shape for s in setups} == set(faults.STRUCTURAL_SHAPES), setting
    assert len(faults.TRANSIENT_SHAPES) == 6
    assert len(faults.STRUCTURAL_SHAPES) == 3
    assert sum(len(seeds) for seeds in faults.HELDOUT_SEEDS.values()) == 66
    # Fresh seeds: none of the design grid's (resnet/vit/gpt 0-6, llama 0-5, minilm 0-4); the GRU is new.
    assert min(faults.HELDOUT_SEEDS["resnet"]) == 7
    assert min(faults.HELDOUT_SEEDS["llama"]) == 6
    assert min(faults.HELDOUT_SEEDS["minilm"]) == 5
    first, seventh = faults.heldout_setup(0), faults.heldout_setup(6)
    assert (first.transient_shape, first.structural_shape) == ("burst10_at200", "jump30_at150")
    assert (seventh.transient_shape, seventh.structural_shape) == ("burst10_at200", "jump30_at150")


def test_the_shapes_corrupt_spike_and_overflow_where_registered(faults):
    def setup(transient, structural="jump10_at300"):
        return dataclasses.replace(faults.FULL, transient_shape=transient, structural_shape=structural)

    shard = setup("shard")
    bad = [p for p in range(400) if shard.corrupted("transient", p)]
    assert bad == [*range(40, 50), *range(140, 150), *range(240, 250), *range(340, 350)]
    assert shard.spike_at("transient", 45) == 1.0  # a corrupted shard: no rate change
    assert not shard.corrupted("healthy", 45)
    assert not shard.corrupted("structural", 45)
    burst = setup("burst30_at245")
    assert [p for p in range(400) if burst.corrupted("transient", p)] == list(range(245, 275))
    assert burst.spike_at("transient", 250) == 20.0
    assert burst.spike_at("transient", 275) == 1.0
    assert (burst.start("transient"), burst.branch("transient")) == (245, 240)  # half-way between two checks
    overflow = setup("overflow")
    assert [p for p in range(400) if overflow.overflowed("transient", p)] == [200, 201, 202]
    assert not any(overflow.corrupted("transient", p) for p in range(400))  # the batches are good ones
    assert overflow.split == 200  # min(200, 300)
    assert setup("shard", "ramp100_slow").split == 40
    # The design setup is unchanged: the 30-batch burst at 200 with x20, both kinds branching at 200.
    design = faults.FULL
    assert [p for p in range(400) if design.corrupted("transient", p)] == list(range(200, 230))
    assert (design.split, design.spike_at("transient", 200)) == (200, 20.0)


def test_structural_shapes_multiply_the_healthy_schedule(faults):
    arch = faults.ARCHITECTURES["gru"]

    def rates(shape):
        setup = dataclasses.replace(faults.FULL, structural_shape=shape)
        trainee = faults.RescueTrainee(arch, 0, "structural", setup)
        healthy = faults.RescueTrainee(arch, 0, "healthy", setup)
        ratio = trainee.scheduler.lr_lambdas[0]
        base = healthy.scheduler.lr_lambdas[0]
        return [ratio(u) / base(u) for u in (0, 99, 100, 149, 150, 240, 299, 300, 380, 399)]

    assert rates("jump30_at150") == [1, 1, 1, 1, 30, 30, 30, 30, 30, 30]
    assert rates("jump10_at300") == [1, 1, 1, 1, 1, 1, 1, 10, 10, 10]
    ramp = rates("ramp100_slow")
    assert ramp[:3] == [1, 1, 1]
    assert ramp[5] == pytest.approx(10.0)  # half-way (update 240 of 100-380): x10
    assert ramp[8] == pytest.approx(100.0)
    assert ramp[9] == pytest.approx(100.0)


def test_an_overflow_makes_every_gradient_infinite_and_the_step_is_taken(faults):
    setup = dataclasses.replace(faults.FULL, transient_shape="overflow")
    trainee = faults.RescueTrainee(faults.ARCHITECTURES["gru"], 0, "transient", setup)
    loss, norm, _ = trainee.step(199)
    assert math.isfinite(loss)
    assert math.isfinite(norm)
    loss, norm, _ = trainee.step(200)
    assert math.isfinite(loss)  # the batch is a good one
    assert not math.isfinite(norm)
    assert not all(torch.isfinite(p).all() for p in trainee.model.parameters())  # the update broke the weights


def test_the_gru_is_a_byte_language_model_with_the_gpt_settings_data_and_probe(faults):
    trainee = faults.ARCHITECTURES["gru"].build(3)
    gpt = faults.ARCHITECTURES["gpt"].build(3)
    assert torch.equal(trainee.probe, gpt.probe)
    assert trainee.batch_size == gpt.batch_size
    assert trainee.optimizer.param_groups[0]["lr"] == 3e-3
    assert trainee.optimizer.param_groups[0]["weight_decay"] == 0.01
    first = float(trainee.loss(0, {}).detach())
    assert first == pytest.approx(math.log(256), rel=0.05)  # untrained: about uniform over the bytes
    metric, features = trainee.evaluate()
    assert features.shape == (512, 64)
    assert metric == pytest.approx(first, rel=0.05)


@pytest.mark.slow
def test_a_faulted_trunk_equals_the_healthy_one_until_its_branch_then_follows_its_shape(engine, faults):
    setup = dataclasses.replace(faults.FULL, steps=160, transient_shape="burst30_at120",
                                structural_shape="ramp100_slow")  # fmt: skip
    trunks = engine.train_trunks(faults.ARCHITECTURES["gru"], 0, setup)
    healthy, transient, structural = trunks["healthy"], trunks["transient"], trunks["structural"]
    assert np.array_equal(transient.loss[:120], healthy.loss[:120])
    assert transient.loss[120] != healthy.loss[120]  # the first bad batch
    assert np.allclose(transient.lr[120:150], 20 * healthy.lr[120:150])
    assert np.array_equal(structural.loss[:101], healthy.loss[:101])  # the ramp is x1 at update 100
    assert np.allclose(structural.lr[101:160] / healthy.lr[101:160],
                       [faults._ramp(u, 100, 280, 1.0, 100.0) for u in range(101, 160)])  # fmt: skip
    assert sorted(structural.states) == sorted(healthy.states)


def record(arm, fault, seed, *, rescued, final, unprotected, healthy=1.0, setting="gpt", shape="s", acted=0):
    """A held-out record as ``build_records`` writes it (a loss: lower is better)."""
    return {"arm": arm, "fault": fault, "seed": seed, "setting": setting, "shape": shape, "rescued": rescued,
            "final_metric": final, "unprotected_final_metric": unprotected, "healthy_twin_final_metric": healthy,
            "unprotected_change": -(unprotected - healthy) / healthy if math.isfinite(unprotected) else -math.inf,
            "change_vs_unprotected": -(final - unprotected) / unprotected if math.isfinite(final) else -math.inf,
            "change_vs_healthy": -(final - healthy) / healthy if math.isfinite(final) else -math.inf,
            "interventions": acted, "warnings": 0}  # fmt: skip


def test_the_analysis_counts_harmed_runs_only_and_judges_each_target_by_its_row(heldout):
    records = []
    for seed in range(10):
        for arm in (*heldout.ROWS, "none+none"):
            saved = arm == heldout.FROZEN and seed < 8
            # Seeds 0-8 harmed (the unprotected twin 10 % worse); seed 9 not harmed (1 % worse).
            unprotected = 1.1 if seed < 9 else 1.01
            final = 1.0 if saved else unprotected
            records.append(record(arm, "transient", seed, rescued=saved or seed == 9, final=final,
                                  unprotected=unprotected))  # fmt: skip
            records.append(record(arm, "structural", seed, rescued=False, final=math.nan, unprotected=math.nan))
            records.append(record(arm, "none", seed, rescued=None, final=1.0, unprotected=1.0, acted=int(seed == 0)))
    result = heldout.analyse(records)
    frozen = result["rows"][heldout.FROZEN]
    assert (frozen["transient"]["rescued"], frozen["transient"]["runs"]) == (8, 9)  # the unharmed seed 9 left out
    assert frozen["transient_not_harmed"] == 1
    assert frozen["structural"]["runs"] == 10  # a non-finite unprotected twin is harmed
    assert frozen["structural"]["rescued"] == 0
    assert frozen["below_unprotected"] == 0  # NaN and a NaN twin: not below
    assert frozen["healthy_acted"] == 1
    assert result["paired"]["ours_loss_only+rollback"] == {"both": 0, "only_a": 8, "only_b": 0,
                                                           "p": pytest.approx(2 / 2**8)}  # fmt: skip
    met = {t["target"].split(" (")[0].split(",")[0]: t["met"] for t in result["targets"]}
    # 8/9 = 89 % with one setting: the bootstrap over settings and seeds has a lower bound > 55 %.
    assert met["transient rescues >= 70% of harmed runs"] is (frozen["transient"]["bootstrap"][0] >= 0.55)
    assert met["structural rescues >= 40% of harmed runs"] is False
    assert met["never below the unprotected twin"] is True
    assert met["healthy twins acted on <= 1 of 10"] is True
    assert all(t["met"] for t in result["targets"] if t["target"].startswith("more rescues"))


def test_the_summary_counts_runs_far_below_their_unprotected_twin_and_the_targets_met(heldout):
    records = []
    for seed in range(6):
        for arm in (*heldout.ROWS, "none+none"):
            ours = arm == heldout.FROZEN
            # Seeds 0-2 of the rule end 50 % worse than the unprotected twin (a loss of 1.65 against 1.1); seed 3
            # 1 % worse (below, but not by more than 2 %); the rest as the unprotected twin.
            final = {0: 1.65, 1: 1.65, 2: 1.65, 3: 1.111}.get(seed, 1.1) if ours else 1.1
            records.append(record(arm, "structural", seed, rescued=False, final=final, unprotected=1.1,
                                  shape="jump" if seed < 2 else "ramp"))  # fmt: skip
            records.append(record(arm, "transient", seed, rescued=ours, final=1.0 if ours else 1.1, unprotected=1.1))
            records.append(record(arm, "none", seed, rescued=None, final=1.0, unprotected=1.0))
    for r in records:
        r["stopped_at"] = 300 if r["seed"] == 0 else None
    payload = {"records": records, **heldout.analyse(records)}
    far = heldout.far_below(records)
    assert (far["runs"], far["harmed"], far["shape_runs"], far["stopped"]) == (3, 3, 2, 1)
    assert far["shape"] == "structural `jump`"
    assert far["worst"] == pytest.approx(-0.5)
    text = heldout.summary(payload)
    assert "rescued 6/6 (100 %, 61-100) harmed transient runs and 0/6 (0 %, 0-39) harmed structural ones" in text
    assert "3 faulted runs ended more than 2 % below their unprotected twin (worst -50 %; 2 of them" in text
    met = sum(t["met"] for t in payload["targets"])
    assert f"Targets met: {met} of {len(payload['targets'])}" in text
