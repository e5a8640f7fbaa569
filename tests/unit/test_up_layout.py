"""kvbus up's choices for the machine it finds: the layout and each engine worker's cores."""

from __future__ import annotations

import pytest

from services.config import ConfigError
from services.up.config import UpConfig
from services.up.placement import DISAGG_MIN_CORES, LEASE_BELOW_CORES_PER_ENGINE, choose_layout, core_sharing, split_cores
from services.up.roles import Site, plan as plan_for


def _args(**kw) -> UpConfig:
    return UpConfig(**kw)


@pytest.mark.parametrize("cores,want", [(1, "aggregated"), (2, "aggregated"), (DISAGG_MIN_CORES - 1, "aggregated"),
                                        (DISAGG_MIN_CORES, "disaggregated"), (64, "disaggregated")])
def test_auto_layout_goes_by_cores(cores, want):
    layout, why = choose_layout(_args(), cores)
    assert layout == want and why.startswith("auto")


def test_explicit_layout_wins_over_cores():
    assert choose_layout(_args(aggregated=True), 64)[0] == "aggregated"
    assert choose_layout(_args(layout="aggregated"), 64)[0] == "aggregated"
    assert choose_layout(_args(prefill=2), 2)[0] == "disaggregated"
    assert choose_layout(_args(decode=1), 2)[0] == "disaggregated"
    assert choose_layout(_args(layout="disaggregated"), 1) == ("disaggregated", "asked for")


def test_one_engine_takes_every_core():
    assert split_cores([0, 1, 2, 3], ["worker-0"], "split") == {"worker-0": (None, 0)}


def test_engines_get_disjoint_slices_decode_takes_the_rest():
    got = split_cores(list(range(7)), ["prefill-0", "decode-0"], "split")
    assert got == {"prefill-0": (frozenset({0, 1, 2}), 3), "decode-0": (frozenset({3, 4, 5, 6}), 4)}
    got = split_cores([4, 5], ["prefill-0", "decode-0"], "split")  # the cores we may use, not 0..n
    assert got == {"prefill-0": (frozenset({4}), 1), "decode-0": (frozenset({5}), 1)}


def test_sharing_or_too_few_cores_divides_threads():
    assert split_cores([0, 1, 2, 3], ["p", "d"], "share") == {"p": (None, 2), "d": (None, 2)}
    assert split_cores([0, 1], ["p0", "p1", "d"], "split") == {"p0": (None, 1), "p1": (None, 1), "d": (None, 1)}


def test_lease_gives_every_engine_every_core():
    assert split_cores([0, 1], ["p", "d"], "lease") == {"p": (None, 2), "d": (None, 2)}


def test_auto_sharing_leases_only_when_a_split_would_starve_an_engine():
    small = list(range(2 * LEASE_BELOW_CORES_PER_ENGINE - 1))
    big = list(range(2 * LEASE_BELOW_CORES_PER_ENGINE))
    assert core_sharing("auto", small, ["p", "d"]) == "lease"
    assert core_sharing("auto", big, ["p", "d"]) == "split"
    assert core_sharing("auto", [0, 1], ["worker-0"]) == "split"  # one engine: nothing to share
    assert core_sharing("share", [0, 1], ["p", "d"]) == "share"
    with pytest.raises(ValueError, match="core sharing"):
        core_sharing("turns", [0, 1], ["p", "d"])


def _plan_args(**kw) -> UpConfig:
    base = dict(layout="disaggregated", prefill=1, decode=1, speculative="off", core_sharing="lease",
                kv_cache_memory=0.5, metrics_port=-1)
    return UpConfig(**{**base, **kw})


def plan(config: UpConfig, nats_url: str, model_dir: str):
    """(roles, children) for ``config``, with a lease file of a fixed name."""
    planned = plan_for(config, Site(nats_url=nats_url, model_dir=model_dir, http_port=config.http_port,
                                    lease_file="/tmp/kvbus-cores-test.lease"))
    return planned.roles, planned.children


def test_plan_gives_leasing_engines_one_file_and_their_own_slots():
    _, children = plan(_plan_args(), "nats://127.0.0.1:4222", "/models/x")
    specs = {}
    for child in children:
        if "--core-lease" in child.argv:
            specs[child.name] = child.argv[child.argv.index("--core-lease") + 1]
            assert child.cpus is None  # no pinning: every engine may use every core
    assert set(specs) == {"prefill-0", "decode-0"}
    paths = {s.rpartition(":")[0] for s in specs.values()}
    assert paths == {"/tmp/kvbus-cores-test.lease"} and sorted(s.rpartition(":")[2] for s in specs.values()) == ["0", "1"]
    _, children = plan(_plan_args(core_sharing="split"), "nats://127.0.0.1:4222", "/models/x")
    assert not any("--core-lease" in c.argv for c in children)


def test_decode_workers_sharing_cores_prefill_short_remainders_themselves():
    from services.up.placement import SHARED_CORES_LOCAL_PREFILL

    def local_tokens(**kw):
        _, children = plan(_plan_args(**kw), "nats://127.0.0.1:4222", "/models/x")
        return {c.name: c.argv[c.argv.index("--local-prefill-tokens") + 1] if "--local-prefill-tokens" in c.argv else None
                for c in children if c.name.startswith(("prefill", "decode"))}

    for sharing in ("lease", "share"):
        assert local_tokens(core_sharing=sharing) == {"prefill-0": None, "decode-0": str(SHARED_CORES_LOCAL_PREFILL)}
    assert local_tokens(core_sharing="split") == {"prefill-0": None, "decode-0": None}  # own cores: the router decides
    # a user's --engine-args come later on the command line, so they win
    _, children = plan(_plan_args(engine_args="--local-prefill-tokens 0"), "nats://127.0.0.1:4222", "/models/x")
    argv = next(c.argv for c in children if c.name == "decode-0")
    assert argv[len(argv) - 1 - argv[::-1].index("--local-prefill-tokens") + 1] == "0"


def test_the_router_draws_the_line_where_the_decode_workers_do():
    """A decode worker keeps prompts whose uncached part is at most its --local-prefill-tokens; the router
    gets --min-disagg-tokens one above it, so it predicts (and counts the load of) the prefill where it
    happens: before, it sent such a prompt to the prefill worker, predicted that worker's (empty) cache,
    and the decode worker kept it anyway."""
    from services.up.placement import SHARED_CORES_LOCAL_PREFILL

    def router_min_disagg(**kw):
        _, children = plan(_plan_args(**kw), "nats://127.0.0.1:4222", "/models/x")
        argv = next(c.argv for c in children if c.name == "router-0")
        return argv[argv.index("--min-disagg-tokens") + 1] if "--min-disagg-tokens" in argv else None

    for sharing in ("lease", "share"):
        assert router_min_disagg(core_sharing=sharing) == str(SHARED_CORES_LOCAL_PREFILL + 1)
    assert router_min_disagg(core_sharing="split") is None  # the router's own default
    assert router_min_disagg(engine_args="--local-prefill-tokens 0") is None
    assert router_min_disagg(engine_args="--max-queue 4 --local-prefill-tokens=300") == "301"
    assert router_min_disagg(core_sharing="split", engine_args="--local-prefill-tokens 64") == "65"


def test_speculation_defaults_to_ngram_for_greedy_requests_on_decoding_engines():
    def flags(**kw):
        _, children = plan(_plan_args(num_speculative_tokens=4, draft_model=None, **kw), "nats://127.0.0.1:4222",
                           "/models/x")
        return {c.name: c.argv for c in children if c.name.startswith(("prefill", "decode", "worker"))}

    auto = flags(speculative="auto")
    assert "--speculative-method" not in auto["prefill-0"]  # a prefill engine never decodes past its first token
    argv = auto["decode-0"]
    assert argv[argv.index("--speculative-method") + 1] == "ngram" and "--speculative-greedy-only" in argv
    every = flags(speculative="ngram", layout="aggregated")["worker-0"]
    assert every[every.index("--speculative-method") + 1] == "ngram" and "--speculative-greedy-only" not in every
    for off in ("off",):  # None, once a missing attribute of an argparse namespace, is now refused:
        assert not any("--speculative-method" in a for a in flags(speculative=off).values())
    with pytest.raises(ConfigError, match="speculative"):
        UpConfig(speculative=None)
