"""Plans in closed form: the charges of the rest of a run, computed from counts, equal the charges
the run makes step by step (the per-step sum a plan used to loop over), for every algorithm of a
shipped recipe, every sampler and mid-run states; and a plan of 10^9 steps takes no time."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from conftest import RECIPES, make_run, sst2_path

ALGORITHMS = {"kl_adaptive_gd_diabetes": [], "kl_proximal_point_logistic": [], "kl_spider_pl": [],
              "klt_mp_zo_erm_ring": [], "klt_oracle_ztc_tree": [], "klt_sp_fo_min_of_norms": [],
              "klt_sp_zo_ring": [], "ztc_l1": [], "ztc_naive_l1": [], "quickstart": [],
              "quadratic_dpgd0th": [], "quadratic_dpzero": [],
              # the HF recipes' algorithms, on the SST-2 sample and the packaged MiniLM
              "minilm_sst2_dpgrape": ["data.k_per_class=64", "data.max_test=8", "sampler.batch_size=32"],
              "minilm_sst2_dpzero": ["data.k_per_class=64", "data.max_test=8"]}


def as_counts(charges) -> Counter:
    out: Counter = Counter()
    for c in charges:
        out[(c.event, c.partition)] += c.count
    return +out


def per_step_plan(run, z) -> list:
    """The charges of every remaining step, one step at a time (what a run charges in the worst
    case the plan covers): the loop plans used to run."""
    from dpreg_kl.algorithms import KLProximalPoint, KLSpider
    from dpreg_nonsmooth.algorithm import O2NCAlgorithm

    alg = run.algorithm
    if alg.adaptive:
        return []
    if isinstance(alg, O2NCAlgorithm):
        return [c for t in range(run.step, alg.total_steps(run))
                for c in run.sampler.account(t, run.privatizer.stream_events(z, run, alg.position(t)[1]), run)]
    if isinstance(alg, KLSpider):  # each round: its anchor, then a difference per step until T_k moves
        s, out = alg.sched, []
        if alg.state.finished or not s.K:
            return out
        k, t, fresh = alg.state.k, alg.state.t, alg.state.fresh
        while k < s.K:
            out.append(run.sampler.account(0, [alg.anchor_event() if fresh else alg.difference_event(k)],
                                           run.ctx)[0])
            fresh, t = False, t + 1
            if t >= int(s.T[k]):
                k, t, fresh = k + 1, 0, True
        return out
    if isinstance(alg, KLProximalPoint):  # T calls of T_A − 1 noisy steps each
        s, out = alg.sched, []
        if alg.state.finished:
            return out
        j = run.update_rule.j if alg.state.started else 1
        for _ in range(alg.state.t, s.T):
            while j < s.T_A:
                out.append(run.sampler.account(0, [alg.event()], run.ctx)[0])
                j += 1
            j = 1
        return out
    per_step = run.privatizer.planned_events(z, run.ctx)
    return [c for t in range(run.step, alg.total_steps(run.ctx)) for c in run.sampler.account(t, per_step, run.ctx)]


def steps_to_try(run) -> list[int]:
    """Run positions around the structure of the run: period/epoch starts and the steps beside."""
    total = run.algorithm.total_steps(run.ctx)
    P = getattr(getattr(run.algorithm, "settings", None), "period", None) or getattr(run.sampler, "per_epoch", 3)
    cands = {0, 1, P - 1, P, P + 1, 2 * P, total // 2, total - 1, total}
    return sorted(s for s in cands if 0 <= s <= total)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_closed_form_plans_equal_the_per_step_charges(name, tmp_path):
    sets = list(ALGORITHMS[name])
    if name.startswith("minilm"):
        sets.append(f"data.path={sst2_path()}")
    run = make_run(RECIPES / f"{name}.yaml", sets=sets + ["train.steps=23"])
    z = getattr(run.privatizer, "noise_multiplier", None)
    for s in steps_to_try(run):
        run.step = s
        _kl_state_at(run, s)  # the KL algorithms: a state part-way through the schedule
        assert as_counts(run.algorithm.plan(run.ctx, z)) == as_counts(per_step_plan(run, z)), (name, s)


def _kl_state_at(run, s: int) -> None:
    """The KL algorithms' counters after s releases of the worst case (every step moves); other
    algorithms are left as they are."""
    from dpreg_kl.algorithms import KLProximalPoint, KLSpider

    alg = run.algorithm
    if isinstance(alg, KLSpider) and alg.sched.K:
        k, t = 0, 0
        for _ in range(s):
            t += 1
            if t >= int(alg.sched.T[k]):
                k, t = k + 1, 0
            if k >= alg.sched.K:
                break
        st = alg.state
        st.k, st.t, st.fresh, st.finished = k, t, t == 0, k >= alg.sched.K
    elif isinstance(alg, KLProximalPoint) and alg.sched.T:
        per, st = alg.sched.T_A - 1, alg.state
        st.t, j = divmod(s, per)
        st.started = j > 0
        run.update_rule.state.j = j + 1
        st.finished = st.t >= alg.sched.T


SAMPLERS = {"poisson": {"name": "poisson", "batch_size": 256},
            "uniform": {"name": "uniform", "batch_size": 256},
            "full_batch": {"name": "full_batch"},
            "shuffle": {"name": "shuffle", "batch_size": 256}}  # 5 batches an epoch of 1,437 records


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_every_sampler_plans_in_closed_form_what_it_charges_step_by_step(sampler):
    import yaml

    recipe = yaml.safe_load((RECIPES / "quickstart.yaml").read_text())
    recipe.update(sampler=SAMPLERS[sampler], accountant="rdp", train={"steps": 23, "progress": False},
                  privatizer={"clip": 4.0, "noise_multiplier": 2.0}, privacy={"epsilon": 1000.0, "delta": 1e-5})
    run = make_run(yaml.safe_dump(recipe), Path(__import__("tempfile").mkdtemp()))
    for s in range(0, 24):  # every position of the epochs (5 steps each) and the run's end
        run.step = s
        assert as_counts(run.algorithm.plan(run.ctx, 2.0)) == as_counts(per_step_plan(run, 2.0)), (sampler, s)


def test_multiples_in_a_range_match_a_count():
    import random

    from dpreg_baseline.samplers import multiples_in

    rng = random.Random(0)
    for _ in range(5000):
        r = range(rng.randint(0, 60), rng.randint(0, 150), rng.randint(1, 12))
        m = rng.randint(1, 15)
        assert multiples_in(r, m) == sum(1 for t in r if t % m == 0), (r, m)


FIXED = ["privatizer.noise_multiplier=2.0", "privacy.epsilon=1.0e+12"]  # a budget the plan fits
BILLION = {"quickstart": ["accountant=rdp", *FIXED], "quickstart zcdp": ["accountant=zcdp", *FIXED],
           "quickstart shuffled": ["accountant=rdp", "sampler={name: shuffle, batch_size: 256}", *FIXED],
           "klt_mp_zo_erm_ring": [], "quadratic_dpzero": []}


@pytest.mark.parametrize("name", sorted(BILLION))
def test_a_run_of_a_billion_steps_is_planned_in_no_time(name):
    """`train.steps: 10^9` (the schema's limit): preparing (calibration included) takes seconds and
    the plan is a handful of counted charges covering every step."""
    t0 = time.perf_counter()
    run = make_run(RECIPES / f"{name.split()[0]}.yaml", sets=BILLION[name] + ["train.steps=1000000000"])
    assert time.perf_counter() - t0 < 30
    z = run.privatizer.noise_multiplier
    t0 = time.perf_counter()
    plan = run.algorithm.plan(run.ctx, z)
    assert time.perf_counter() - t0 < 1.0
    assert len(plan) <= 8
    charged = sum(c.count for c in plan)
    if run.sampler.name == "shuffle":  # one release an epoch of 5 steps
        assert charged == -(-10**9 // 5)
    elif name.startswith("quickstart"):  # one sampled release a step
        assert charged == 10**9
    else:  # every step charges (a release and its failure probability)
        assert charged >= run.algorithm.total_steps(run.ctx) > 0


def test_steps_beyond_the_limit_are_refused_by_the_schema(tmp_path):
    from dpregistry.errors import UserError
    from dpregistry.limits import MAX_STEPS
    from dpregistry.recipe import load

    with pytest.raises(UserError, match="less than or equal to 1000000000") as e:
        load(RECIPES / "quickstart.yaml", [f"train.steps={MAX_STEPS + 1}"])
    assert e.value.key == "train.steps"
    assert MAX_STEPS == 10**9
