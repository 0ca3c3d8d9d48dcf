"""`qserve`: a thin command line over the engine: pull, info, generate, bench.

User errors (a bad flag, an unknown model, a prompt that cannot run) print one line,
`error: ...`, on stderr and exit 2; Ctrl-C exits 130. Torch and the engine are imported only
by the commands that need them, so `--help` and argument errors stay instant.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import click

from qserve import __version__
from qserve.errors import QServeError
from qserve.server.reasoning import PARSERS as REASONING_PARSERS

USER_ERROR, INTERRUPTED = 2, 130


class _Main(click.Group):
    """Runs a command and turns user errors into one line each, never a traceback."""

    def main(self, args=None, prog_name=None, **extra):
        extra["standalone_mode"] = False
        try:
            rv = super().main(args, prog_name, **extra)
        except click.UsageError as e:
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
            _fail(e.format_message() + hint, e.exit_code)
        except click.ClickException as e:
            _fail(e.format_message(), e.exit_code)
        except QServeError as e:
            _fail(str(e), USER_ERROR)
        except (click.Abort, KeyboardInterrupt):
            sys.exit(INTERRUPTED)
        except BrokenPipeError:  # `qserve generate ... | head`: stop quietly, as cat does
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _fail(message: str, code: int) -> None:
    first = message.strip().splitlines()[0] if message.strip() else "failed"
    click.echo(f"error: {first}", err=True)
    sys.exit(code)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, message="qserve %(version)s")
def main():
    """qserve: quantization-first LLM inference on one GPU or a CPU box."""


# ---- engine flags, shared by every command that runs a model ------------------------------
_ENGINE_FLAGS = [
    click.option("--kv-cache-memory", metavar="SIZE",
                 help="KV cache budget, e.g. 512MiB  [default: room for --max-num-seqs "
                      "sequences of --max-model-len tokens, at most 10% of free memory]"),
    click.option("--swap-space", metavar="SIZE", default="1GiB", show_default=True,
                 help="Host memory for swapped-out KV blocks."),
    click.option("--block-size", type=int, default=16, show_default=True,
                 help="Tokens per KV cache block."),
    click.option("--max-num-seqs", type=int,
                 help="Most sequences in one step; the default KV pool holds this many full "
                      "sequences  [default: 256; chat: 1; generate: the completions asked "
                      "for; bench: the largest batch]"),
    click.option("--max-num-batched-tokens", type=int,
                 help="Most tokens in one step (a prompt longer than that is prefilled in "
                      "chunks)  [default: 512 on a CPU, 2048 on CUDA]"),
    click.option("--max-model-len", type=int,
                 help="Longest prompt + completion, in tokens  [default: the model's]"),
    click.option("--preemption-mode", type=click.Choice(["recompute", "swap"]),
                 default="recompute", show_default=True),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
                 show_default=True),
    click.option("--kv-dtype",
                 type=click.Choice(["auto", "fp32", "fp16", "bf16", "int8", "int4"]),
                 default="auto", show_default=True,
                 help="KV cache dtype (auto: a qserve checkpoint's recipe KV dtype, else "
                      "fp16 on a CPU for weights below fp32 with int8 activations, else "
                      "--dtype; int8/int4: quantized in the blocks; int4: 4 bits a value, "
                      "keys by a per-model calibrated codebook)."),
    click.option("--dtype", type=click.Choice(["auto", "fp32", "fp16", "bf16"]),
                 default="auto", show_default=True,
                 help="Activation and dense weight dtype (auto: bf16 on CUDA, fp32 on CPU)."),
    click.option("--weights", type=click.Choice(["native", "dense"]), default="native",
                 show_default=True,
                 help="native: run the file's own precision (a GGUF's Q4_K stays Q4_K, fp16 "
                      "stays fp16); dense: dequantize every weight to --dtype."),
    click.option("--no-prefix-caching", is_flag=True, help="Do not reuse cached prompt blocks."),
    click.option("--kv-offload", type=click.Choice(["off", "layerwise"]), default="off",
                 show_default=True,
                 help="layerwise: start prompts with device blocks for a few layers, keeping "
                      "their K/V in host memory until they decode (lower time to first token "
                      "when the KV pool is full)."),
    click.option("--kv-offload-lookahead", type=int, default=4, show_default=True,
                 metavar="LAYERS", help="Layers of a layer-wise prefill in flight at once."),
    click.option("--kv-offload-reserve", type=float, default=0.1, show_default=True,
                 metavar="FRACTION",
                 help="Share of the KV pool kept for layer-wise prefills: higher favours time "
                      "to first token, lower favours decode batch size."),
]
_ENGINE_NAMES = ("kv_cache_memory", "swap_space", "block_size", "max_num_seqs",
                 "max_num_batched_tokens", "max_model_len", "preemption_mode", "device",
                 "kv_dtype", "dtype", "weights", "kv_offload", "kv_offload_lookahead",
                 "kv_offload_reserve")


_SPEC_FLAGS = [
    click.option("--draft", metavar="MODEL|self:RECIPE|ngram",
                 help="Speculative decoding: a draft model with the same vocabulary, the "
                      "model's own weights quantized with RECIPE (e.g. self:w4g64), or ngram "
                      "(prompt lookup, no model)."),
    click.option("--num-speculative-tokens", type=int, metavar="K",
                 help="Most draft tokens verified per step  [default: 4; needs --draft]"),
]
_SPEC_NAMES = ("draft", "num_speculative_tokens")


def speculative_flags(f):
    """Add --draft and --num-speculative-tokens; put above @engine_flags, which passes them on
    in `engine`."""
    for flag in reversed(_SPEC_FLAGS):
        f = flag(f)
    return f


def engine_flags(f=None, *, only: tuple[str, ...] | None = None):
    """Add the engine flags to a command; it receives them as one dict, `engine`, keyed by
    `engine_config()` field names (with the speculative flags, when the command has them).
    `only`: the flags (by their --long-name) of a command that uses only some (info, eval)."""
    if f is None:
        return functools.partial(engine_flags, only=only)

    @functools.wraps(f)
    def wrapper(**kw):
        engine = {name: kw.pop(name) for name in _ENGINE_NAMES + _SPEC_NAMES if name in kw}
        if "no_prefix_caching" in kw:
            engine["enable_prefix_caching"] = not kw.pop("no_prefix_caching")
        return f(engine=engine, **kw)
    for flag in reversed(_ENGINE_FLAGS):
        probe = flag(lambda: None)  # the option's name, to filter by `only`
        if only is None or probe.__click_params__[0].opts[0] in only:
            wrapper = flag(wrapper)
    return wrapper


def model_argument(f):
    """MODEL as a positional argument (as `ollama run MODEL`), with -m/--model accepted as the
    same thing, so every command names a model one way."""
    @functools.wraps(f)
    def wrapper(model, model_opt, **kw):
        if model is not None and model_opt is not None and model != model_opt:
            raise click.UsageError(f"MODEL {model!r} and --model {model_opt!r} disagree; "
                                   f"give one")
        return f(model=model if model is not None else model_opt, **kw)
    wrapper = click.option("--model", "-m", "model_opt", metavar="MODEL",
                           help="The same as the MODEL argument.")(wrapper)
    return click.argument("model", required=False)(wrapper)


def _json_output(ctx, param, value: bool) -> bool:
    """--json's callback: stdout is data, so the command draws no spinner or bar at all."""
    if value:
        from qserve.progress import off

        ctx.with_resource(off())
    return value


def _build_engine(model: str | None, engine: dict, on=None):
    """The engine for MODEL, with a spinner on a terminal while it loads, then one status line
    on stderr: what runs, at which precision, where, and the KV budget. `on`: the EngineThread
    to load it on (the server's, which then steps it), else this thread."""
    import time

    from qserve.config import engine_config
    from qserve.llm import make_engine
    from qserve.loader.registry import resolve_model
    from qserve.progress import spinner

    config = engine_config(model, **engine)  # a bad flag fails before the spinner starts
    resolve_model(model)  # a first run's download draws its own progress, not under a spinner
    t0 = time.monotonic()
    with spinner(f"loading {model or 'the default model'}"):
        eng = make_engine(config) if on is None else on.call(lambda: make_engine(config))
    click.echo(f"qserve: {status_line(eng)}, loaded in {time.monotonic() - t0:.1f}s", err=True)
    return eng


def status_line(eng) -> str:
    """`SmolLM2-135M-Instruct.Q4_1.gguf (llama, 135M params) · weights int4 94%, ... ·
    cpu fp32 · 2 threads · KV fp32 8,192 tokens (360 MiB)`: what `eng` runs, and how; then
    `· context 37,184 of 131,072 tokens` where the run's context is shorter than the model's
    (--max-model-len, or as much as fit the KV budget)."""
    import torch

    from qserve.engine.cache_engine import bytes_per_block
    from qserve.models.registry import num_params

    weights = ""
    plan = getattr(eng, "memory_plan", None)
    if plan is not None and plan.weight_formats:
        total = sum(v["bytes"] for v in plan.weight_formats.values()) or 1
        shares = sorted(((v["bytes"] / total, f) for f, v in plan.weight_formats.items()),
                        reverse=True)
        in_file = (f", embedding {plan.file_weight_bytes / 2**20:,.0f} MiB read from the file"
                   if plan.file_weight_bytes else "")
        weights = (" · weights " + ", ".join(f"{f} {100 * r:.0f}%" for r, f in shares
                                             if r >= 0.01)
                   + f" ({total / 2**20:,.0f} MiB{in_file})")
    blocks = eng.stats()["kv_blocks_total"]
    tokens = blocks * eng.config.cache.block_size
    per_block = bytes_per_block(eng.arch, eng.config.cache.block_size, eng.kv_dtype)
    kv_mib = blocks * per_block / 2**20
    n = torch.get_num_threads()
    threads = f" · {n} thread{'s' * (n != 1)}" if eng.device.type == "cpu" else ""
    spec, context = eng.config.speculative, eng.arch.max_position_embeddings
    return (f"{Path(str(eng.model_path)).name} ({eng.arch.architecture}, "
            f"{num_params(eng.arch) / 1e6:,.0f}M params){weights} · {eng.device.type} "
            f"{_dtype_name(eng.dtype)}{threads} · KV {_dtype_name(eng.kv_dtype)} "
            f"{tokens:,} tokens ({kv_mib:,.0f} MiB)"
            + (f" · context {eng.max_model_len:,} of {context:,} tokens"
               if eng.max_model_len < context else "")
            + (f" · draft {spec.draft}" if spec is not None else ""))


def _dtype_name(dtype) -> str:
    from qserve.engine.cache_engine import dtype_name

    return dtype_name(dtype)


# ---- pull --------------------------------------------------------------------------------
@main.command()
@model_argument
@click.option("--force", is_flag=True, help="Download again even if cached.")
def pull(model, force):
    """Download MODEL (an alias or ORG/NAME; default: the default model); print its path."""
    from qserve.errors import ModelLoadError
    from qserve.loader.registry import pull as pull_model, resolve_model

    path = None
    if not force:
        try:
            path = resolve_model(model, download=False)
        except ModelLoadError:  # not cached (or corrupt): download it
            pass
    click.echo(path or pull_model(model))


# ---- info --------------------------------------------------------------------------------
# the engine flags that change what info reports (the pools, the plan); it runs nothing
_INFO_FLAGS = ("--kv-cache-memory", "--swap-space", "--block-size", "--max-num-seqs",
               "--max-num-batched-tokens", "--max-model-len", "--device", "--kv-dtype",
               "--dtype", "--weights")


@main.command()
@model_argument
@click.option("--json", "as_json", is_flag=True, callback=_json_output,
              help="Print one JSON object.")
@engine_flags(only=_INFO_FLAGS)
def info(model, as_json, engine):
    """Shape, size and KV cache footprint of MODEL, without loading its weights."""
    import torch

    from qserve.config import engine_config
    from qserve.engine.cache_engine import KV_STORAGE, bytes_per_block, fit_context, plan_num_blocks
    from qserve.errors import ConfigError
    from qserve.loader import load_arch, resolve_model

    config = engine_config(model, **engine)
    path = resolve_model(model)
    arch = load_arch(path)
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    bs, device = config.cache.block_size, torch.device(config.resolved_device())
    max_num_seqs = config.scheduler.max_num_seqs

    def fit(kv_dtype) -> tuple[int, object]:
        """The engine's context length and cache config at this KV dtype (fit_context)."""
        if config.scheduler.max_model_len is not None:
            return config.scheduler.max_model_len, config.cache
        return fit_context(arch.max_position_embeddings, config.cache,
                           bytes_per_block(arch, bs, kv_dtype), device, max_num_seqs)

    def pool(kv_dtype) -> tuple[int, int, int]:
        """The engine's (device, host) KV blocks, (0, 0) where it would refuse the budget, and
        its context length."""
        max_len, cache = fit(kv_dtype)
        try:
            return (*plan_num_blocks(arch, cache, kv_dtype, device, max_len, max_num_seqs),
                    max_len)
        except ConfigError:  # info reports; the engine refuses
            return 0, 0, max_len

    kv_per_token, kv_tokens, kv_per_gib = {}, {}, {}
    for name, dtype in KV_STORAGE.items():  # int8 / int4 count their scales and offsets too
        try:
            per_block = bytes_per_block(arch, bs, dtype)
        except ConfigError:  # a KV dtype this model's shape cannot use
            continue
        kv_per_token[name] = per_block // bs
        kv_tokens[name] = pool(dtype)[0] * bs  # whole blocks only, as the engine allocates
        kv_per_gib[name] = (1 << 30) // per_block * bs
    from qserve.models.registry import num_params

    from qserve.loader.gguf_loader import GGUFFile, read_pooling
    from qserve.loader.hf_loader import read_pooling as read_hf_pooling, vision_language

    n = num_params(arch)
    wrapper = vision_language(path) if path.is_dir() else None
    pooling = read_hf_pooling(path) if path.is_dir() else read_pooling(GGUFFile(path))
    report = {
        "model": str(path), "architecture": arch.architecture,
        **({} if wrapper is None else {"vision_language": (
            f"{wrapper}: its language model alone (the vision tower is not loaded; text in, "
            f"text out)")}),
        **({} if pooling is None else {"pooling": pooling}),  # an embedding model's own
        **({} if arch.generates else {"generates": False}),  # no output layer: embeds only
        "num_layers": arch.num_layers,
        "num_heads": arch.num_heads, "num_kv_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim, "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size, "vocab_size": arch.vocab_size,
        "context_length": arch.max_position_embeddings, "num_params": n,
        "weight_bytes": {"fp32": 4 * n, "fp16": 2 * n},
        "file_bytes": sum(p.stat().st_size for p in files),
        "kv_bytes_per_token": kv_per_token,
        "kv_cache_memory": None,  # the pool at the KV dtype in use, filled in below
        "kv_tokens": kv_tokens,  # tokens of KV cache the engine's pool holds, per KV dtype
        "kv_tokens_per_gib": kv_per_gib,
    }
    from qserve.engine.cache_engine import DTYPES
    from qserve.engine.memory_plan import plan_memory, resolve_kv_dtype
    from qserve.loader.checkpoint import quantization_config

    quant = quantization_config(path) if path.is_dir() else None
    dtype = DTYPES[config.resolved_dtype()]
    kv_dtype = resolve_kv_dtype(path, arch, config)
    blocks, host_blocks, max_len = pool(kv_dtype)
    per_block = bytes_per_block(arch, bs, kv_dtype)
    report["max_model_len"] = max_len  # the context a run with these flags gets
    report["kv_cache_memory"] = blocks * per_block
    report["dtype"], report["kv_dtype"] = _dtype_name(dtype), _dtype_name(kv_dtype)
    plan = plan_memory(path, arch, config, device=device, dtype=dtype,
                       kv_bytes=blocks * per_block, host_kv_bytes=host_blocks * per_block,
                       max_model_len=max_len)
    if not path.is_dir():  # GGML type -> tensor count, as the file stores them
        from collections import Counter

        from qserve.loader.gguf_loader import tensor_types

        report["gguf_types"] = dict(Counter(tensor_types(GGUFFile(path), arch).values()))
    report["weight_formats"] = plan.weight_formats  # format -> tensors, resident bytes
    report["weight_bytes"]["resident"] = plan.weight_bytes
    report["memory_plan"] = plan.to_dict() | {"weight_formats": None}
    if quant is not None:  # a qserve checkpoint: what a --dtype fp16 engine keeps resident
        from qserve.quant.quantize import resident_bytes

        res = resident_bytes(path, arch)
        report["weight_bytes"]["resident_fp16_engine"] = res["resident_bytes_fp16_engine"]
        report["resident_vs_fp16"] = {
            "with_embedding": round(res["resident_ratio"], 4),
            "without_embedding": round(res["resident_ratio_without_embedding"], 4)}
        report["recipe"] = quant.get("recipe", {}).get("name")
        report["recipe_kv_dtype"] = quant.get("kv_dtype")  # what --kv-dtype auto uses
    if as_json:
        click.echo(json.dumps(report))
        return
    report["weight_formats"] = {f: f"x{v['tensors']} ({v['bytes'] / 1e6:.1f} MB)"
                                for f, v in plan.weight_formats.items()}
    report["memory_plan"] = (f"{plan.total_bytes / 2**30:.2f} GiB needed of "
                             f"{plan.available_bytes / 2**30:.2f} GiB available "
                             f"({'fits' if plan.total_bytes <= plan.available_bytes else 'does NOT fit'})")
    width = max(map(len, report))
    for key, value in report.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}"
                              for k, v in value.items())
        elif isinstance(value, int):
            value = f"{value:,}"
        click.echo(f"{key:<{width}}  {'auto' if value is None else value}")


# ---- generate ----------------------------------------------------------------------------
@main.command()
@click.argument("prompts", nargs=-1)
@click.option("--model", "-m", help="Alias, .gguf file, HF directory or ORG/NAME.")
@click.option("--prompts-file", type=click.Path(dir_okay=False, allow_dash=True),
              help="One prompt per line (blank lines skipped); - reads stdin.")
@click.option("--chat", is_flag=True, help="Wrap each prompt in the model's chat template.")
@click.option("--system", help="System message for --chat (implies --chat).")
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.7, show_default=True, help="0: greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0: off.")
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
@click.option("--presence-penalty", type=float, default=0.0, show_default=True)
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, help="Makes sampling reproducible.")
@click.option("--stop", multiple=True, help="Stop string; may be repeated.")
@click.option("--n", "-n", "n", type=int, default=1, show_default=True,
              help="Completions per prompt.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence.")
@click.option("--json-schema", "schema_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Constrain each completion to JSON valid against this JSON schema.")
@click.option("--json", "as_json", is_flag=True, callback=_json_output,
              help="One JSON object per completion per line, with timings.")
@speculative_flags
@engine_flags
def generate(prompts, model, prompts_file, chat, system, schema_file, as_json, engine,
             **sampling):
    """Complete PROMPTs (or --prompts-file, or stdin lines). One prompt streams as it goes;
    several run concurrently and print in order. Without --model, a first PROMPT naming a .gguf
    file or a model directory is the model (`qserve generate model.gguf "Hello"`)."""
    from qserve.sampling_params import SamplingParams

    if model is None and prompts and _names_a_model(prompts[0]):
        model, prompts = prompts[0], prompts[1:]
    params = SamplingParams(**sampling)
    schema = _read_schema(schema_file) if schema_file is not None else None
    texts = _read_prompts(prompts, prompts_file)
    for i, text in enumerate(texts):  # the engine checks too, but only after loading the model
        if not text:
            raise QServeError(f"prompt {i + 1} is empty; give at least one token of text")
    if engine.get("max_num_seqs") is None:  # a KV pool for what was asked, not 256 sequences
        engine["max_num_seqs"] = min(256, len(texts) * params.n)
    eng = _build_engine(model, engine)
    if schema is not None:
        params = dataclasses.replace(params, constraint=_schema_constraint(eng, schema,
                                                                           schema_file))
    chat = chat or system is not None
    ids = [_chat_ids(eng.tokenizer, t, system) if chat else None for t in texts]
    stream = len(texts) == 1 and params.n == 1 and not as_json
    outputs = _run(eng, texts, ids, params, stream)
    if stream:
        if not outputs[0].outputs[0].text.endswith("\n"):
            click.echo()
        return
    for i, out in enumerate(outputs):
        for c in out.outputs:
            if as_json:
                record = _completion_record(i, out, c, engine.get("draft") is not None)
                click.echo(json.dumps(record, ensure_ascii=False))
            else:
                tag = f"{i + 1}" + (f".{c.index + 1}" if params.n > 1 else "")
                click.echo(f"--- [{tag}] {c.text}")


def _names_a_model(text: str) -> bool:
    """Whether a PROMPT is a model's path, as in `ollama run MODEL PROMPT`: one word ending in
    .gguf (a missing one then fails as a model path, not completed as text), or an existing
    directory with a config.json."""
    if not text or any(c.isspace() for c in text):
        return False
    if text.lower().endswith(".gguf"):
        return True
    path = Path(text).expanduser()
    return path.is_dir() and (path / "config.json").is_file()


def _read_schema(path: str) -> str:
    """--json-schema FILE's text, checked to be a JSON object before the model loads."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        if not isinstance(json.loads(text), dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        why = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0][:80] or type(
            e).__name__
        raise QServeError(f"--json-schema {path!r} is not a JSON schema object: {why}") from None
    return text


def _schema_constraint(eng, schema: str, path: str):
    """The grammar constraint for a JSON schema (the server's structured outputs)."""
    try:
        from qserve.server.structured import Grammars, Structure, StructureError
    except ImportError as e:  # the server extra is missing
        raise QServeError(f"--json-schema needs the server extra: pip install "
                          f"'qserve[server]' ({e})") from None
    try:
        return Grammars(eng.tokenizer).constraint(
            Structure(grammar=("json_schema", schema)))
    except StructureError as e:
        raise QServeError(f"--json-schema {path!r}: {e}") from None


def _read_prompts(prompts: tuple[str, ...], prompts_file: str | None) -> list[str]:
    texts = list(prompts)
    source = None
    if prompts_file == "-" or (prompts_file is None and not texts and not sys.stdin.isatty()):
        try:
            source = sys.stdin.read()
        except UnicodeDecodeError:
            raise QServeError("stdin is not UTF-8 text; give prompts as text, one per "
                              "line") from None
    elif prompts_file is not None:
        try:
            source = Path(prompts_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise QServeError(f"--prompts-file {prompts_file!r} cannot be read: {why}") from None
    if source is not None:
        texts += [line for line in source.splitlines() if line.strip()]
    if not texts:
        raise QServeError("no prompt given; pass PROMPT arguments, --prompts-file FILE, "
                          "or prompts on stdin, one per line")
    return texts


def _chat_ids(tokenizer, text: str, system: str | None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": text})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def _run(engine, texts: list[str], ids: list[list[int] | None], params, stream: bool):
    """Run every prompt to completion; with `stream`, write text to stdout as it arrives.
    Whatever happens (an error, Ctrl-C), no request is left holding KV blocks."""
    rids = [f"cli-{i}" for i in range(len(texts))]
    finished = {}
    if not stream:  # only the finished outputs are read
        params = dataclasses.replace(params, output_kind="final_only")
    try:
        for rid, text, prompt_ids in zip(rids, texts, ids):
            engine.add_request(rid, text, params, prompt_token_ids=prompt_ids)
        while len(finished) < len(rids):
            for out in engine.step():
                if stream and out.outputs[0].delta_text:
                    sys.stdout.write(out.outputs[0].delta_text)
                    sys.stdout.flush()
                if out.finished:
                    finished[out.request_id] = out
    finally:
        for rid in rids:
            engine.abort(rid)
    return [finished[rid] for rid in rids]


def _completion_record(prompt_index: int, out, c, speculative: bool = False) -> dict:
    m = out.metrics
    ttft = m.first_token_time - m.arrival_time if m.first_token_time is not None else None
    decode_s = (m.finished_time - m.first_token_time
                if m.finished_time is not None and m.first_token_time is not None else 0)
    n = len(c.token_ids)
    record = {
        "prompt_index": prompt_index, "index": c.index, "text": c.text,
        "token_ids": c.token_ids, "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": n, "finish_reason": c.finish_reason, "ttft_s": ttft,
        "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
    }
    if speculative:
        record |= {"spec_draft_tokens": c.spec_draft_tokens,
                   "spec_accepted_tokens": c.spec_accepted_tokens,
                   "spec_acceptance_rate": c.spec_acceptance_rate,
                   "spec_mean_accepted_tokens": c.spec_mean_accepted_tokens}
    return record


# ---- bench -------------------------------------------------------------------------------
def _batch_sizes(ctx, param, value: str) -> list[int]:
    try:
        sizes = [int(s) for s in value.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of positive integers")
    if max(sizes) > MAX_BENCH_BATCH:  # (each batch's random prompts are made up front)
        raise click.BadParameter(f"a batch of {max(sizes)} prompts is more than bench runs "
                                 f"(at most {MAX_BENCH_BATCH:,})")
    return sizes


MAX_BENCH_BATCH = 65536


@main.command()
@model_argument
@click.option("--batch-sizes", default="1,8,32", show_default=True, callback=_batch_sizes,
              help="Comma-separated batch sizes to measure.")
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the random prompts.")
@click.option("--json", "as_json", is_flag=True, callback=_json_output,
              help="One JSON object per batch size per line.")
@speculative_flags
@engine_flags
def bench(model, batch_sizes, input_len, output_len, seed, as_json, engine):
    """Prefill and decode throughput, TTFT, TPOT and peak memory of MODEL on random prompts
    (greedy, ignoring EOS), one row per batch size."""
    from qserve.bench import format_table, run_bench

    if engine.get("max_num_seqs") is None:  # the default KV pool: the largest batch, no more
        engine["max_num_seqs"] = max(batch_sizes)
    if engine.get("max_model_len") is None:
        engine["max_model_len"] = input_len + output_len
    rows = run_bench(_build_engine(model, engine), batch_sizes, input_len, output_len, seed=seed,
                     progress=not as_json)
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
    else:
        click.echo(format_table(rows))


# ---- eval --------------------------------------------------------------------------------
# eval scores one window at a time with no prefix cache: --max-model-len is --context, and the
# batching, preemption, swap and offload flags have nothing to act on
_EVAL_FLAGS = ("--kv-cache-memory", "--block-size", "--max-num-batched-tokens", "--device",
               "--kv-dtype", "--dtype", "--weights")


@main.command("eval")
@model_argument
@click.option("--ref", metavar="MODEL",
              help="Reference model (same tokenizer): adds mean KL(ref || MODEL) and top-1 "
                   "agreement. It runs with --kv-dtype auto.")
@click.option("--text", "text_file", type=click.Path(dir_okay=False),
              help="UTF-8 text to score  [default: Python's pydoc topics text]")
@click.option("--context", type=click.IntRange(min=2), default=1024, show_default=True,
              help="Tokens per window; windows do not overlap.")
@click.option("--score-tokens", type=click.IntRange(min=2), metavar="N",
              help="Score only the text's first N tokens  [default: all]")
@click.option("--max-tokens", "old_max_tokens", type=int, hidden=True)  # its old name
@click.option("--json", "as_json", is_flag=True, callback=_json_output,
              help="Print one JSON object.")
@engine_flags(only=_EVAL_FLAGS)
def eval_(model, ref, text_file, context, score_tokens, old_max_tokens, as_json, engine):
    """Perplexity of MODEL over a text through the engine (quantized KV included); with
    --ref, KL divergence and top-1 agreement against a reference model."""
    from qserve.config import engine_config
    from qserve.eval import default_text, eval_engine, evaluate, tokenize_for_eval
    from qserve.loader.registry import resolve_model
    from qserve.progress import spinner

    if old_max_tokens is not None:  # --max-tokens counts output tokens in every other command
        raise QServeError(f"eval generates no tokens, so it has no --max-tokens; to score the "
                          f"text's first {old_max_tokens} tokens use --score-tokens "
                          f"{old_max_tokens}")
    if text_file is None:
        text = default_text()
    else:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
            raise QServeError(f"--text {text_file!r} cannot be read: {why}") from None
    resolve_model(model)  # a first run's download draws its own progress, not under a spinner
    with spinner(f"loading {model or 'the default model'}"):
        eng = eval_engine(model, context, **engine)
    click.echo(f"qserve: {status_line(eng)}", err=True)
    ref_eng = None
    if ref:
        resolve_model(ref)
        with spinner(f"loading the reference {ref}"):
            # the reference keeps K/V at its own compute dtype (fp32 on a CPU), whatever
            # --kv-dtype the model under test uses and whatever its recipe would choose
            full = engine_config(ref, **engine).resolved_dtype()
            ref_eng = eval_engine(ref, context, **{**engine, "kv_dtype": full})
        click.echo(f"qserve: reference {status_line(ref_eng)}", err=True)
    result = evaluate(eng, tokenize_for_eval(eng, text, score_tokens, ref_eng), context,
                      ref_eng, progress=not as_json)
    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    click.echo(f"model    {result.model}  ({result.dtype}, KV {result.kv_dtype})")
    click.echo(f"tokens   {result.num_tokens:,} scored in {result.num_windows} windows of "
               f"{result.context}")
    click.echo(f"PPL      {result.ppl:.4f}")
    if result.ref is not None:
        click.echo(f"ref      {result.ref}  PPL {result.ref_ppl:.4f}  "
                   f"({100 * (result.ppl / result.ref_ppl - 1):+.2f}%)")
        click.echo(f"KL       {result.kl:.5f} nats/token")
        click.echo(f"top-1    {100 * result.top1:.2f}%")


# ---- serve -------------------------------------------------------------------------------
_CLUSTER_FLAGS = [
    click.option("--replicas", type=int, metavar="N",
                 help="Serve N copies of the model as Ray Serve replicas behind one endpoint, "
                      "routing by prompt prefix (needs pip install 'qserve[cluster]')."),
    click.option("--ray-address", metavar="ADDRESS",
                 help="Join this Ray cluster (e.g. ray://head:10001 or auto)  [default: start "
                      "a local one; needs --replicas]"),
    click.option("--replica-cpus", type=float, default=1.0, show_default=True,
                 help="CPUs Ray reserves for each replica."),
    click.option("--replica-gpus", type=float, default=0.0, show_default=True,
                 help="GPUs Ray reserves for each replica (> 0: --device auto is that GPU)."),
    click.option("--min-replicas", type=int, metavar="N",
                 help="Autoscale between --min-replicas and --max-replicas."),
    click.option("--max-replicas", type=int, metavar="N"),
    click.option("--target-ongoing-requests", type=float, metavar="N",
                 help="Autoscaling target of requests in flight per replica."),
    click.option("--routing", type=click.Choice(["prefix", "round-robin"]), default="prefix",
                 show_default=True,
                 help="prefix: a request goes to the replica that ran its prompt's prefix, "
                      "else the least loaded; round-robin: the baseline."),
]
_CLUSTER_NAMES = ("replicas", "ray_address", "replica_cpus", "replica_gpus", "min_replicas",
                  "max_replicas", "target_ongoing_requests", "routing")


def cluster_flags(f):
    """Add the --replicas flags; the command receives them as one dict, `cluster`."""
    @functools.wraps(f)
    def wrapper(**kw):
        return f(cluster={name: kw.pop(name) for name in _CLUSTER_NAMES}, **kw)
    for flag in reversed(_CLUSTER_FLAGS):
        wrapper = flag(wrapper)
    return wrapper


def _serve_replicas(cluster: dict, model, engine: dict, model_name: str, config) -> None:
    """`serve --replicas`: the same app on Ray Serve (Ray is imported only here)."""
    try:
        from qserve.server import cluster as ray_cluster
    except ImportError as e:
        raise QServeError(f"--replicas needs Ray Serve ({e}); install it with pip install "
                          f"'qserve[cluster]'") from None
    cfg = ray_cluster.ClusterConfig(**cluster)
    if engine.get("max_num_seqs"):
        cfg.max_ongoing_requests = engine["max_num_seqs"]
    ray_cluster.run(cfg, model, engine, model_name, config)


@main.command()
@model_argument
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", envvar="QSERVE_API_KEY", metavar="KEY",
              help="Require `Authorization: Bearer KEY` on /v1, /api, /tokenize, /detokenize "
                   "and /metrics (also $QSERVE_API_KEY). Without a key only loopback clients "
                   "are served.")
@click.option("--allowed-origins", metavar="ORIGIN,...", default="",
              help="Browser origins (e.g. http://localhost:3000, or *) allowed to call the "
                   "server, with CORS  [default: loopback origins, without CORS]")
@click.option("--max-request-bytes", metavar="SIZE", default="4MiB", show_default=True,
              help="Larger request bodies are refused (413) before they are read.")
@click.option("--shutdown-timeout", type=float, default=30.0, show_default=True,
              metavar="SECONDS",
              help="At Ctrl-C / SIGTERM, how long running requests get to finish.")
@click.option("--served-model-name", metavar="NAME",
              help="The model id clients send  [default: MODEL, or the default model's alias]")
@click.option("--max-waiting", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Queued requests beyond this are refused with 503.")
@click.option("--reasoning-parser", type=click.Choice(REASONING_PARSERS), default="auto",
              show_default=True,
              help="How a chat answer's thinking is read off into reasoning_content (Ollama: "
                   "thinking): think (<think>...</think>), harmony (gpt-oss), none (left in "
                   "the content), auto (from the model's chat template and vocabulary).")
@cluster_flags
@speculative_flags
@engine_flags
def serve(model, host, port, api_key, allowed_origins, max_request_bytes, shutdown_timeout,
          served_model_name, max_waiting, reasoning_parser, cluster, engine):
    """An OpenAI- and Ollama-compatible HTTP server for MODEL (Ctrl-C or SIGTERM stops it)."""
    _require_extra("server", "qserve serve", "fastapi", "uvicorn", "prometheus_client")
    from qserve.config import parse_size
    from qserve.loader.registry import DEFAULT_MODEL
    from qserve.server.api import serve as run_server
    from qserve.server.async_engine import EngineThread
    from qserve.server.config import LOOPBACK, ServerConfig, listen_socket

    config = ServerConfig(host, port, api_key,
                          tuple(o.strip() for o in allowed_origins.split(",") if o.strip()),
                          parse_size(max_request_bytes, "--max-request-bytes"),
                          shutdown_timeout, reasoning_parser=reasoning_parser)
    if cluster["replicas"] is None and any(
            cluster[k] is not None for k in ("ray_address", "min_replicas", "max_replicas",
                                             "target_ongoing_requests")):
        raise click.UsageError("--ray-address and the autoscaling flags need --replicas")
    # bound before the model loads: a bad --host or a port in use fails at once
    sock = listen_socket(host, port)
    if host not in LOOPBACK and not api_key:
        click.echo(f"warning: serving on {host} without an API key; anyone who can reach "
                   f"port {port} can use it (set --api-key or QSERVE_API_KEY)", err=True)
    if cluster["replicas"] is not None:  # Ray Serve's proxy binds the address itself
        sock.close()
        _serve_replicas(cluster, model, dict(engine, max_waiting=max_waiting),
                        served_model_name or model or DEFAULT_MODEL, config)
        return
    with sock:
        thread = EngineThread()
        eng = _build_engine(model, dict(engine, max_waiting=max_waiting), on=thread)
        name = served_model_name or model or DEFAULT_MODEL
        click.echo(f"qserve: serving {name!r} at {_url(host, sock.getsockname()[1])}/v1 "
                   f"(OpenAI-compatible; Ctrl-C stops it)", err=True)
        run_server(eng, name, config, thread, sock=sock)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _require_extra(extra: str, what: str, *modules: str) -> None:
    """One line naming the extra to install when an optional dependency is missing."""
    import importlib.util

    def absent(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is None
        except ImportError:  # a finder that refuses it (a broken install, the tests' blocker)
            return True

    missing = [m for m in modules if absent(m)]
    if missing:
        raise QServeError(f"{what} needs {', '.join(missing)}, from the {extra!r} extra: "
                          f"pip install 'qserve[{extra}]' (in a checkout: pip install -e "
                          f"'.[{extra}]')")


# ---- chat --------------------------------------------------------------------------------
_CHAT_SAMPLING_FLAGS = [
    click.option("--max-tokens", type=int, default=512, show_default=True,
                 help="Longest reply, in tokens (the context may allow fewer)."),
    click.option("--temperature", type=float, default=0.7, show_default=True, help="0: greedy."),
    click.option("--top-p", type=float, default=1.0, show_default=True),
    click.option("--top-k", type=int, default=0, show_default=True, help="0: off."),
    click.option("--min-p", type=float, default=0.0, show_default=True),
    click.option("--repetition-penalty", type=float, default=1.0, show_default=True),
    click.option("--presence-penalty", type=float, default=0.0, show_default=True),
    click.option("--frequency-penalty", type=float, default=0.0, show_default=True),
    click.option("--seed", type=int, help="Makes sampling reproducible."),
]


def _chat_sampling_flags(f):
    for flag in reversed(_CHAT_SAMPLING_FLAGS):
        f = flag(f)
    return f


@main.command()
@model_argument
@click.option("--system", help="System prompt.")
@click.option("--reasoning-parser", type=click.Choice(REASONING_PARSERS), default="auto",
              show_default=True,
              help="How a reply's thinking is told from its answer: think (<think>...</think>), "
                   "harmony (gpt-oss), none (printed as generated), auto (from the model).")
@click.option("--hide-thinking", is_flag=True,
              help="Print only the answer of a model that thinks first.")
@_chat_sampling_flags
@speculative_flags
@engine_flags
def chat(model, system, reasoning_parser, hide_thinking, engine, **sampling):
    """Talk with MODEL in the terminal; replies stream as they are generated. Piped, each
    input line is one message and gets one reply. /help lists the commands."""
    from qserve.chat import ChatSession, run
    from qserve.loader.registry import DEFAULT_MODEL
    from qserve.sampling_params import SamplingParams
    from qserve.server.reasoning import reasoning_format

    params = SamplingParams(**sampling)
    if engine.get("max_num_seqs") is None:  # one conversation: a KV pool for one sequence
        engine["max_num_seqs"] = 1
    eng = _build_engine(model, engine)
    run(ChatSession(eng, params, system, model or DEFAULT_MODEL,
                    reasoning=reasoning_format(reasoning_parser, eng.tokenizer),
                    show_thinking=not hide_thinking))


# ---- quantize ----------------------------------------------------------------------------
@main.command()
@click.argument("src")
@click.option("--output", "-o", "out", required=True, metavar="OUT",
              help="Checkpoint directory (with --format gguf, a .gguf file) to write; must not "
                   "exist unless --force.")
@click.option("--recipe", "-r", metavar="NAME|PATH",
              help="A recipes/*.yaml name or a YAML path  [default: a qserve checkpoint or "
                   "AWQ/GPTQ directory copied as stored, gguf-native for a GGUF with quantized "
                   "linears (its blocks kept, lossless), else w4g64]")
@click.option("--calib-text", type=click.Path(dir_okay=False), metavar="FILE",
              help="Calibration text for AWQ recipes  [default: Python's pydoc_data.topics]")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--format", "fmt", type=click.Choice(["qserve", "gguf", "compressed-tensors"]),
              default="qserve", show_default=True,
              help="qserve: a checkpoint directory; gguf: one .gguf file llama.cpp runs (w4g32 "
                   "-> Q4_1, int4 g32 sym -> Q4_0, int8 g32 -> Q8_0); compressed-tensors: a "
                   "directory vLLM reads (int8, int4 sym). Other recipes are refused.")
@click.option("--json", "as_json", is_flag=True, callback=_json_output,
              help="Print the summary as one JSON object.")
def quantize(src, out, recipe, calib_text, force, fmt, as_json):
    """Quantize SRC (alias, .gguf, HF directory or ORG/NAME) into the qserve checkpoint OUT,
    which every command then loads like any model, or export it (--format) for llama.cpp or
    vLLM with the very same weights."""
    import contextlib

    from qserve.progress import bar as progress_bar, spinner
    from qserve.quant.quantize import quantize as run_quantize

    loading = contextlib.ExitStack()  # a spinner while the model loads, until the first step
    loading.enter_context(spinner(f"loading {src}", disable=as_json))
    shown = None  # made at the first finished step, so an early error prints alone

    def progress(label: str, total: int) -> None:
        nonlocal shown
        if shown is None:
            loading.close()
            shown = progress_bar(total, "quantize", unit="step", disable=as_json)
        shown.set_postfix_str(label)
        shown.update()
    try:
        summary = run_quantize(src, out, recipe, calib_text, force, progress, fmt)
    finally:
        loading.close()
        if shown is not None:
            shown.close()
    if as_json:
        click.echo(json.dumps(summary))
        return
    click.echo(_layer_summary(summary["layers"]))
    click.echo(f"recipe {summary['recipe']}: {summary['out']}\n"
               f"bytes  fp16 {summary['bytes_fp16']:,} -> written {summary['bytes']:,}\n"
               f"resident at --dtype fp16: {summary['resident_ratio']:.3f}x fp16 with the "
               f"embedding, {summary['resident_ratio_without_embedding']:.3f}x without")


def _layer_summary(layers: list[dict]) -> str:
    """quantize's per-layer rows folded into one line per (scheme, note): how many tensors,
    their bytes at fp16 and as written (--json lists every layer)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for row in layers:
        g = groups.setdefault((row["scheme"], row["note"]), [0, 0, 0])
        g[0], g[1], g[2] = g[0] + 1, g[1] + row["bytes_fp16"], g[2] + row["bytes"]
    lines = [f"{'tensors':>7}  {'scheme':<20} {'fp16 bytes':>13}    {'bytes':>11}  note"]
    for (scheme, note), (n, fp16, written) in groups.items():
        lines.append(f"{n:>7}  {scheme:<20} {fp16:>13,} -> {written:>11,}  {note}")
    return "\n".join(lines)
