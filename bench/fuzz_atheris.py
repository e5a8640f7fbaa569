"""Coverage-guided fuzzing (atheris, libFuzzer) of the code that reads untrusted bytes.

    pip install atheris                          # not in the test extras: only this script needs it
    python -m bench.fuzz_atheris                 # 100,000 inputs per target, ~5 minutes on 2 cores
    python -m bench.fuzz_atheris --runs 2000     # a quick check
    python -m bench.fuzz_atheris --only http     # targets whose name contains this

bench/fuzz.py drives the running services with structure-aware hypothesis inputs; this one
complements it where coverage guidance pays: the decoders and validators every message and HTTP
body goes through before any work, fed with mutated bytes that libFuzzer steers towards new
branches of our Python code (instrumented at import). Targets:

  nats SUBJECT (JSON | msgpack)  bus.codec.decode of every public subject's request type, with the
                                 Struct's own checks (SamplingParams bounds, chat roles, ...)
  http completions / chat        the gateway's body decoding, mapping to a GenerateRequest and the
                                 checks before work (services/gateway: openai_mapping, validation)

An input passes when it decodes or is refused with a typed error (bus.errors: the gateway's
error_response gives it a 4xx); anything else (another exception type, a 5xx) is a crash: the
target's libFuzzer run stops there, writes the input next to its log, and this script reports it.
Each target runs in its own process (libFuzzer exits when done). Seeds are fixed (-seed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _targets() -> dict[str, tuple[str, str]]:
    """name -> (kind, argument) for the child processes."""
    from bus.subjects import ALL_SUBJECTS

    out = {}
    for s in ALL_SUBJECTS:
        if s.public:
            for enc in ("json", "msgpack"):
                out[f"nats {s.template} ({enc})"] = ("nats", f"{s.template}|{enc}")
    out["http completions"] = ("http", "completions")
    out["http chat completions"] = ("http", "chat")
    return out


# Valid inputs the mutations start from, so libFuzzer reaches the checks behind the decoder.
_SAMPLING = {"max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3,
             "stop": ["x"], "stop_token_ids": [2], "logprobs": 2}
SEEDS = {
    "kvbus.v1.generate": [{"prompt": "hi", "sampling": _SAMPLING}, {"prompt_token_ids": [1, 2, 3]}],
    "kvbus.v1.generate.once": [{"prompt": "hi", "sampling": _SAMPLING}, {"prompt_token_ids": [1, 2, 3]}],
    "completions": [{"model": "m", "prompt": "hi", "max_tokens": 4, "temperature": 0.5, "stop": ["x"],
                     "logprobs": 2, "stream": True}, {"model": "m", "prompt": [1, 2, 3]}],
    "chat": [{"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
              "max_tokens": 4, "top_p": 0.5},
             {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}],
}


def _write_seeds(kind: str, arg: str, corpus: str) -> None:
    import json

    import msgspec

    key = arg.split("|")[0]
    for i, seed in enumerate(SEEDS.get(key, [])):
        data = msgspec.msgpack.encode(seed) if arg.endswith("|msgpack") else json.dumps(seed).encode()
        with open(f"{corpus}/seed-{i}", "wb") as f:
            f.write(data)


def _child(kind: str, arg: str, runs: int, seed: int, workdir: str) -> None:
    import atheris

    with atheris.instrument_imports(include=["bus", "schemas", "services"]):
        from bus.codec import Encoding, decode
        from bus.errors import BusError
        from bus.subjects import ALL_SUBJECTS
        from services.gateway.openai_mapping import chat_to_generate, completion_to_generate, decode_body, \
            error_response
        from services.gateway.openai_schemas import ChatCompletionRequest, CompletionRequest
        from services.gateway.validation import check_before_work

    if kind == "nats":
        template, enc_name = arg.split("|")
        [subject] = [s for s in ALL_SUBJECTS if s.template == template]
        enc = Encoding.JSON if enc_name == "json" else Encoding.MSGPACK

        def one(data: bytes) -> None:
            try:
                decode(data, subject.request, enc, subject=template)
            except BusError:
                pass  # a typed refusal
    else:
        type_, to_generate = ((CompletionRequest, completion_to_generate) if arg == "completions"
                              else (ChatCompletionRequest, chat_to_generate))

        def one(data: bytes) -> None:
            try:
                check_before_work(to_generate(decode_body(data, type_)), 2048)
            except Exception as exc:  # the gateway answers every exception through error_response
                status, _ = error_response(exc)
                if status >= 500:
                    raise

    atheris.Setup([sys.argv[0], f"-runs={runs}", f"-seed={seed}", "-max_len=4096", "-print_final_stats=1",
                   f"-artifact_prefix={workdir}/", workdir + "/corpus"], one)
    atheris.Fuzz()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz_atheris", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100_000, help="inputs per target")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", default="")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1], args.runs, args.seed, args.workdir)
        return 0
    import importlib.util

    if importlib.util.find_spec("atheris") is None:
        print("bench.fuzz_atheris needs atheris: pip install atheris", file=sys.stderr)
        return 2
    rows, bad = [], False
    for name, (kind, arg) in _targets().items():
        if args.only not in name:
            continue
        workdir = tempfile.mkdtemp(prefix="kvbus-atheris-")
        os.makedirs(workdir + "/corpus")
        _write_seeds(kind, arg, workdir + "/corpus")
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "bench.fuzz_atheris", "--child", kind, arg, "--runs",
                              str(args.runs), "--seed", str(args.seed), "--workdir", workdir],
                             capture_output=True, text=True)
        seconds = time.monotonic() - t0
        log = res.stdout + res.stderr
        done = next((line.split()[-1] for line in log.splitlines() if "stat::number_of_executed_units" in line), "?")
        cov = next((line.split("cov: ")[1].split()[0] for line in reversed(log.splitlines()) if "cov: " in line), "?")
        crashed = res.returncode != 0
        bad |= crashed
        rows.append((name, done, cov, "crash" if crashed else "0", f"{seconds:.0f}"))
        print(f"{name}: {done} inputs, coverage {cov}, {'CRASH' if crashed else 'ok'} in {seconds:.0f}s",
              file=sys.stderr, flush=True)
        if crashed:
            print(log[-3000:], file=sys.stderr)
    print(f"\natheris (libFuzzer), {args.runs} inputs asked per target, seed {args.seed}\n")
    print("| target | inputs run | coverage (edges) | crashes | seconds |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
