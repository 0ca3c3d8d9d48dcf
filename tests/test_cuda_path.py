"""The CUDA path's failures that a CPU can show: tensors made on the wrong device (caught on
the `meta` device, which refuses to mix with CPU tensors as CUDA does), the bf16 default on
CUDA, no gguf import where the GPU machine has no gguf package, and the pure-Python parts of
CUDA-graph decode (engine/cuda_graph.py): bucket choice and the persistent buffers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from qserve.config import EngineConfig
from qserve.engine import cuda_graph
from qserve.engine.cuda_graph import (PAD_SLOT, DecodeBuffers, batch_buckets, bucket_for,
                                      context_bucket)
from qserve.engine.sampler import race
from qserve.kernels.paged_attention import PagedAttentionMetadata, paged_attention, write_kv

REPO = Path(__file__).resolve().parent.parent
META = torch.device("meta")


def _meta_step(kv_dtype, query_lens, window=None, device=META):
    """A layer cache, metadata and q/k on `device` for two sequences of 9 and 3 tokens."""
    H, hkv, d, page, T = 4, 2, 32, 8, sum(query_lens)
    cache = {w: torch.empty(6, page, hkv, d, device=device, dtype=kv_dtype) for w in "kv"}
    if kv_dtype == torch.int8:
        for name in ("k_scale", "v_scale"):
            cache[name] = torch.empty(6, page, hkv, device=device, dtype=torch.float16)
    meta = PagedAttentionMetadata(
        slot_mapping=torch.zeros(T, dtype=torch.long, device=device),
        query_start_loc=torch.zeros(3, dtype=torch.long, device=device),
        seq_lens=torch.zeros(2, dtype=torch.long, device=device),
        block_tables=torch.zeros(2, 2, dtype=torch.long, device=device),
        query_lens_list=list(query_lens), seq_lens_list=[9, 3], max_seq_len=9,
        decode_only=all(n == 1 for n in query_lens), sliding_window=window)
    q = torch.empty(T, H, d, device=device, dtype=torch.float16)
    k = torch.empty(T, hkv, d, device=device, dtype=torch.float16)
    return q, k, cache, meta


class CpuTensorsMade(TorchFunctionMode):
    """Records every torch function that returns a CPU tensor while the inputs are not."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.ops.append(getattr(func, "__name__", str(func)))
        return out


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.int8])
@pytest.mark.parametrize("query_lens,window", [([1, 1], None), ([1, 1], 4), ([5, 1], None),
                                               ([5, 3], 4)])
def test_reference_attention_makes_its_tensors_on_the_query_device(kv_dtype, query_lens, window):
    """The reference (QSERVE_KERNELS=reference, and what every Triton test compares with)
    used to build its positions and masks on the CPU: on CUDA that fails."""
    q, k, cache, meta = _meta_step(kv_dtype, query_lens, window)
    with CpuTensorsMade() as made:  # meta tensors mix with CPU ones; so watch what is made
        k2, v2 = write_kv(k, k, cache, meta.slot_mapping)
        out = paged_attention(q, cache, meta, 0.1, k_new=k2, v_new=v2)
    assert out.shape == q.shape and out.device == META
    assert not made.ops, f"CPU tensors made by {made.ops}"


def test_reference_attention_asserts_one_device():
    q, _, cache, meta = _meta_step(torch.float16, [5, 1])
    meta.block_tables = torch.zeros(2, 2, dtype=torch.long)  # on the CPU
    with pytest.raises(AssertionError, match="block_tables"):
        paged_attention(q, cache, meta, 0.1)


def test_seeded_race_draws_from_a_generator_on_another_device():
    """A seeded row whose generator is not on the logits' device (the engine used to make
    every generator on the CPU) draws there and copies: no crash on CUDA, and the draw is
    the generator's own."""
    probs = torch.rand(3, 50)
    out = race(probs.to(META), [None, torch.Generator().manual_seed(1), None])
    assert out.shape == (3,) and out.device == META
    # on one device the copy path gives the same token as drawing in place
    a = race(probs.clone(), [torch.Generator().manual_seed(7)] * 1 + [None, None])[0]
    u = torch.empty(50).uniform_(generator=torch.Generator().manual_seed(7))
    assert a == int((probs[0] / -u.log()).argmax())


def test_dtype_defaults_to_bf16_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert EngineConfig().resolved_dtype() == "fp32"
    assert EngineConfig(device="cpu", dtype="bf16").resolved_dtype() == "bf16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig().resolved_dtype() == "bf16"
    assert EngineConfig(dtype="fp16").resolved_dtype() == "fp16"
    assert EngineConfig(device="cpu").resolved_dtype() == "fp32"


BLOCK_GGUF = """
import importlib.abc, sys
class NoGguf(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "gguf" or name.startswith("gguf."):
            raise ImportError("gguf is blocked (the GPU machine has no gguf package)")
sys.meta_path.insert(0, NoGguf())
"""


def test_cuda_path_imports_without_gguf():
    """Everything an engine on a qserve checkpoint imports loads with gguf blocked."""
    code = BLOCK_GGUF + (
        "import qserve.llm, qserve.cli, qserve.engine.llm_engine, qserve.kernels.dispatch\n"
        "import qserve.loader, qserve.loader.checkpoint, qserve.engine.cuda_graph\n"
        "assert not any(m == 'gguf' or m.startswith('gguf.') for m in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


# ---- CUDA-graph decode: the parts that are plain Python -----------------------------------
def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    b = batch_buckets(40)
    assert [bucket_for(n, b) for n in (1, 3, 8, 9, 16, 17, 33, 40, 41)] == [
        1, 4, 8, 16, 16, 32, 40, 40, None]


def test_context_bucket():
    assert [context_bucket(n, 8192) for n in (1, 256, 257, 1000, 4097, 8192)] == [
        256, 256, 512, 1024, 8192, 8192]
    assert context_bucket(300, 300) == 300 and context_bucket(10, 100) == 100


def test_decode_buffers_pad_and_update_in_place():
    buf = DecodeBuffers(max_batch=4, max_blocks=3, device=torch.device("cpu"), pin=False)
    ptr = buf.device_flat.data_ptr()
    views = [buf.input_ids, buf.positions, buf.slot_mapping, buf.seq_lens, buf.block_tables]
    buf.block_tables.fill_(9)  # stale entries: only what a row reads must be written
    buf.update([11, 12], [5, 20], [45, 7], [6, 21], torch.tensor([[5, 0, 0], [0, 2, 1]]),
               bucket=4)
    assert buf.device_flat.data_ptr() == ptr  # captured graphs keep reading the same memory
    assert all(ptr <= v.data_ptr() < ptr + buf.device_flat.nbytes for v in views)
    assert buf.input_ids.tolist() == [11, 12, 0, 0]
    assert buf.positions.tolist() == [5, 20, 0, 0]
    assert buf.slot_mapping.tolist() == [45, 7, PAD_SLOT, PAD_SLOT]
    assert buf.seq_lens.tolist() == [6, 21, 1, 1]
    # row i reads its first ceil(seq_len / block) entries; a padding row reads entry 0
    assert buf.block_tables[0, :1].tolist() == [5] and buf.block_tables[1].tolist() == [0, 2, 1]
    assert buf.block_tables[2:, 0].tolist() == [0, 0]
    # a smaller step after a larger one: no old row survives where the bucket reads
    buf.update([3], [9], [17], [10], torch.tensor([[2, 4]]), bucket=2)
    assert buf.slot_mapping[:2].tolist() == [17, PAD_SLOT] and buf.seq_lens[:2].tolist() == [10, 1]
    assert buf.block_tables[0, :2].tolist() == [2, 4] and buf.block_tables[1, 0] == 0
    meta = buf.metadata(2, max_seq_len=24, sliding_window=None)
    assert meta.decode_only and meta.max_seq_len == 24 and meta.query_lens_list == [1, 1]
    assert meta.query_start_loc.tolist() == [0, 1, 2]
    assert meta.block_tables.shape == (2, 3) and meta.block_tables.data_ptr() == (
        buf.block_tables.data_ptr())
    with pytest.raises(AssertionError):
        buf.update([1] * 5, [0] * 5, [0] * 5, [1] * 5, torch.zeros(5, 1, dtype=torch.int64),
                   bucket=4)  # above max_batch


def test_cuda_graphs_only_on_cuda(monkeypatch):
    assert not cuda_graph.enabled(torch.device("cpu"))
    monkeypatch.setenv("QSERVE_CUDA_GRAPHS", "0")
    assert not cuda_graph.enabled(torch.device("cuda"))


# ---- the GPU run's fixture and script -----------------------------------------------------
def test_gpu_fixture_fits_a_device_run():
    """.gpu/ (scripts/make_gpu_fixture.py) stays well under the 64 MiB a run may carry."""
    import json

    files = [f for f in (REPO / ".gpu").rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 45e6
    ref = json.loads((REPO / ".gpu" / "reference.json").read_text())
    assert set(ref["kv"]) == {"fp32", "int8", "int4"}
    for outs in ref["kv"].values():
        assert all(len(o["token_ids"]) == len(o["logprobs"]) == ref["max_tokens"] for o in outs)
    assert (REPO / ".gpu" / "model" / "tokenizer.json").exists()


def test_gpu_e2e_check_runs_on_cpu(tmp_path):
    """scripts/gpu_e2e.py check on the CPU with the reference kernels: the fixture's own
    path, so its greedy tokens must come back exactly (and gguf is blocked throughout)."""
    import os

    env = dict(os.environ, QSERVE_KERNELS="reference", QSERVE_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_e2e.py"), "check",
                        "--device", "cpu", "--dtypes", "fp32", "--kv", "fp32",
                        "--cases", "greedy,chunked", "--max-tokens", "4"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| greedy fp32 KV fp32 | PASS | 16/16 tokens" in r.stdout
    assert "| chunked prefill | PASS |" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("**GO**")


class _EagerReplay:
    """A 'graph' whose replay runs the model now, on DecodeGraphs' persistent buffers."""

    def __init__(self, graphs, key):
        self.graphs, self.key = graphs, key
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.graphs.outputs[self.key] = self.graphs._forward(self.key)


class _CpuGraphs(cuda_graph.DecodeGraphs):
    """DecodeGraphs with capture = remember the bucket: the graph path's data flow (buffers,
    bucket metadata, the runner's seam) on the CPU, where nothing can be captured."""

    def _capture(self, key):
        self.graphs[key] = _EagerReplay(self, key)
        return True


def test_decode_through_the_graph_seam_matches_eager():
    """Decode steps routed through DecodeGraphs (its buffers and metadata, contexts padded to
    their bucket) give the same greedy tokens as the eager runner; prefill steps do not go
    through it. Buckets of every size here: padding rows are a CUDA-only path (slot -1,
    which only the Triton KV write skips)."""
    from qserve.llm import LLM
    from qserve.sampling_params import SamplingParams

    model = str(REPO / ".gpu" / "model")
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model, device="cpu").generate(prompts, params)]
    llm = LLM(model, device="cpu", max_model_len=512)
    runner = llm.engine.runner
    graphs = _CpuGraphs(runner.model, runner.layer_caches, runner.device, 4, 512,
                        runner.block_size, runner.sliding_window)
    graphs.buckets = [1, 2, 3, 4]
    runner.graphs = graphs
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert graphs.graphs and all(g.replays for g in graphs.graphs.values())
    assert sum(g.replays for g in graphs.graphs.values()) == 5  # the 5 decode steps
