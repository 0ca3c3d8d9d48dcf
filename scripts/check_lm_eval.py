#!/usr/bin/env python3
"""lm-evaluation-harness against `qserve serve`: a small multiple-choice task scored through
`local-completions` (prompt logprobs over /v1/completions with echo) and through lm-eval's own
`hf` backend on the same weights, per-choice loglikelihoods side by side.

    pip install 'lm-eval[api]'   # beside qserve's torch: it needs torch, which must stay 2.13.0+cpu
    python scripts/check_lm_eval.py [--hf-dir DIR]

Offline: the task's questions are written here (no dataset download); the Hugging Face
directory is the default model converted to fp32 (the suite's `.cache/qserve/hf-ref/...`,
made by tests/conftest.py), and the server runs the same file with `--weights dense` (fp32),
so the two should agree to float rounding.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin", " Newton"], 0),
    ("The largest planet in the solar system is", [" Mars", " Jupiter", " Mercury"], 1),
    ("The opposite of hot is", [" cold", " loud", " tall"], 0),
    ("Two plus two equals", [" seven", " four", " nine"], 1),
    ("The sun rises in the", [" west", " north", " east"], 2),
    ("A baby cat is called a", [" kitten", " puppy", " calf"], 0),
    ("The color of the sky on a clear day is", [" green", " blue", " red"], 1),
]
TASK = """task: qserve_check_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def lm_eval(work: Path, name: str, model: str, args: str) -> list[list[float]]:
    """Run the task with one lm-eval backend; each question's choice loglikelihoods."""
    out = work / name
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", args,
           "--tasks", "qserve_check_mc", "--include_path", str(work), "--log_samples",
           "--output_path", str(out), "--batch_size", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"error: lm_eval --model {model} failed: {r.stderr.strip()[-600:]}")
    samples = [json.loads(line) for f in glob.glob(f"{out}/*/samples_*.jsonl")
               for line in open(f)]
    return [[float(resp[0][0]) for resp in s["resps"]]
            for s in sorted(samples, key=lambda s: s["doc_id"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-dir", type=Path, default=next(
        iter(sorted((REPO / ".cache" / "qserve" / "hf-ref").glob("*/"))), None))
    args = ap.parse_args()
    if args.hf_dir is None or not (args.hf_dir / "config.json").exists():
        sys.exit("error: no Hugging Face directory of the default model: give --hf-dir (the "
                 "suite makes one under .cache/qserve/hf-ref)")
    for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[k] = "1"
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        work = Path(tmp)
        (work / "data.jsonl").write_text("".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
            for q, c, a in QUESTIONS))
        (work / "qserve_check_mc.yaml").write_text(TASK.format(data=work / "data.jsonl"))
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        server = subprocess.Popen([sys.executable, "-m", "qserve", "serve", "--port", str(port),
                                   "--weights", "dense", "--max-model-len", "512"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            for _ in range(300):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except OSError:
                    if server.poll() is not None:
                        sys.exit(f"error: qserve serve exited: {server.stderr.read()[-600:]}")
                    time.sleep(0.5)
            served = lm_eval(work, "qserve", "local-completions",
                             f"model=smollm2-135m-instruct,base_url=http://127.0.0.1:{port}"
                             f"/v1/completions,tokenizer={args.hf_dir},"
                             f"tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
        finally:
            server.terminate()
            server.wait(60)
        ref = lm_eval(work, "hf", "hf", f"pretrained={args.hf_dir},dtype=float32")
    print("| question | choice loglikelihoods, qserve serve (local-completions) "
          "| lm-eval hf | most apart |\n|---|---|---|---|")
    worst = 0.0
    for (q, _, _), a, b in zip(QUESTIONS, served, ref):
        apart = max(abs(x - y) for x, y in zip(a, b))
        worst = max(worst, apart)
        print(f"| {q} | {', '.join(f'{x:.4f}' for x in a)} | "
              f"{', '.join(f'{x:.4f}' for x in b)} | {apart:.1e} |")
    hits = [sum(max(range(len(a)), key=a.__getitem__) == t for a, (_, _, t) in
                zip(r, QUESTIONS)) for r in (served, ref)]
    print(f"\naccuracy {hits[0]}/{len(QUESTIONS)} (qserve) and {hits[1]}/{len(QUESTIONS)} (hf); "
          f"loglikelihoods at most {worst:.1e} nats apart")
    sys.exit(0 if worst < 1e-3 else 1)


if __name__ == "__main__":
    main()
