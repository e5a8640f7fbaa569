"""--dtype auto: bfloat16 where the device computes it natively, float32 elsewhere; kvbus up
resolves it once, hands it to every engine and says it."""

from __future__ import annotations

import asyncio

import pytest

from services.engine.dtypes import BF16_FLAGS, cpu_flags, resolve_dtype
from services.up.command import start_services
from services.up.config import UpConfig
from services.up.roles import Site, plan

SAPPHIRE_RAPIDS = frozenset("avx2 fma avx512f avx512bw avx512_bf16 amx_tile amx_bf16".split())
ZEN4 = frozenset("avx2 fma avx512f avx512bw avx512_bf16".split())
SKYLAKE_X = frozenset("avx2 fma avx512f avx512bw".split())
ZEN3 = frozenset("avx2 fma".split())
SITE = Site(nats_url="nats://127.0.0.1:4222", model_dir="/models/x", http_port=8123)


@pytest.mark.parametrize("flags,dtype,named", [
    (SAPPHIRE_RAPIDS, "bfloat16", "amx_bf16, avx512_bf16"), (ZEN4, "bfloat16", "avx512_bf16"),
    (SKYLAKE_X, "float32", "neither amx_bf16 nor avx512_bf16"), (ZEN3, "float32", "neither amx_bf16 nor avx512_bf16"),
    (frozenset(), "float32", "neither"),
], ids=["sapphire-rapids", "zen4", "skylake-x", "zen3", "no-cpuinfo"])
def test_auto_is_bf16_only_where_the_cpu_computes_it(flags, dtype, named):
    got, why = resolve_dtype("auto", "cpu", flags=flags)
    assert got == dtype and why.startswith("auto: ") and named in why


def test_an_asked_dtype_is_kept_whatever_the_cpu():
    for asked in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(asked, "cpu", flags=SAPPHIRE_RAPIDS) == (asked, f"--dtype {asked}")
        assert resolve_dtype(asked, "cpu", flags=ZEN3)[0] == asked


def test_cuda_follows_its_bf16_support():
    assert resolve_dtype("auto", "cuda", cuda_bf16=True)[0] == "bfloat16"
    assert resolve_dtype("auto", "cuda:1", cuda_bf16=False)[0] == "float32"


def test_this_machine():
    flags = cpu_flags()
    dtype, why = resolve_dtype("auto")
    assert dtype == ("bfloat16" if any(f in flags for f in BF16_FLAGS) else "float32"), why


def _engine_dtypes(config: UpConfig) -> set[str]:
    children = plan(config, SITE, cores=[0, 1]).children
    engines = [c.argv for c in children if c.name.startswith(("worker", "prefill", "decode"))]
    assert engines, [c.name for c in children]
    return {argv[argv.index("--dtype") + 1] for argv in engines}


def test_kvbus_up_hands_every_engine_the_resolved_dtype():
    auto, _ = resolve_dtype("auto")
    assert _engine_dtypes(UpConfig(metrics_port=-1)) == {auto}  # "auto" never reaches an engine
    assert _engine_dtypes(UpConfig(metrics_port=-1, prefill=1, decode=1)) == {auto}
    assert _engine_dtypes(UpConfig(metrics_port=-1, dtype="bfloat16")) == {"bfloat16"}
    # an engine's own --dtype in --engine-args comes after kvbus up's, and kvbus up says it wins
    config = UpConfig(metrics_port=-1, engine_args="--dtype float16")
    assert config.engine_dtype()[1].endswith("--engine-args sets its own --dtype, which wins")


class _Recorder:
    """Records what kvbus up starts (the dtype line is said before any process starts)."""

    def __init__(self):
        self.started = []

    async def start(self, child):
        self.started.append(child)


def test_kvbus_up_prints_the_choice(capsys):
    recorder = _Recorder()
    asyncio.run(start_services(UpConfig(metrics_port=-1), SITE, recorder))
    dtype, why = resolve_dtype("auto")
    assert f"[kvbus] dtype: {dtype} ({why})" in capsys.readouterr().out.splitlines()
    assert recorder.started  # and the services were then started
    asyncio.run(start_services(UpConfig(metrics_port=-1, tokenizer_only=True), SITE, _Recorder()))
    assert "dtype:" not in capsys.readouterr().out  # no engine, nothing to say
