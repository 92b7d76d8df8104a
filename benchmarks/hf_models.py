"""The built-in GPT against transformers' own classes, per training step on CPU (issue 13).

    python benchmarks/hf_models.py [--rounds 5] [--steps 20]

Why the stages keep our GPT (tasks/model/gpt.py) for arch "gpt" and save it as the GPT-2 it is:
forward + backward + AdamW step of the same model as our GPT and as transformers'
GPT2LMHeadModel (same weights, logits equal), and of a LlamaForCausalLM of the same width and
depth (for scale), at the demo recipe's size (2 layers, 128 wide, vocab 1024, 16 x 128 tokens)
and the tiny recipe's (1 layer, 32 wide, vocab 300, 8 x 32 tokens). Rounds alternate the models
so load changes hit each alike; the median of the per-round means is reported. One torch
thread, as the jobs run on a shared 2-core box.

Writes benchmarks/results/hf_models.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from benchmarks.pretrain_common import machine  # noqa: E402 - at start: the load then

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tasks.model.causal_lm import build_model, gpt_to_hf  # noqa: E402
from tasks.configs import ModelConfig  # noqa: E402

SIZES = {
    "demo": (ModelConfig(vocab_size=1024, block_size=128, n_layer=2, n_head=4, n_embd=128), 16),
    "tiny": (ModelConfig(vocab_size=300, block_size=32, n_layer=1, n_head=2, n_embd=32), 8),
}


def models(cfg: ModelConfig) -> dict[str, torch.nn.Module]:
    import dataclasses

    torch.manual_seed(0)
    gpt = build_model(cfg)
    llama = build_model(dataclasses.replace(cfg, arch="llama"))
    return {"gpt": gpt, "gpt2_transformers": gpt_to_hf(gpt).train(), "llama_transformers": llama.hf}


def loss_of(name: str, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return model(x[:, :-1], x[:, 1:])[1]
    logits = model(input_ids=x[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())


def step_ms(name: str, model: torch.nn.Module, x: torch.Tensor, steps: int,
            optimizer: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        loss_of(name, model, x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return 1000 * (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loads = [os.getloadavg()]
    out: dict = {"benchmark": "hf_models", "rounds": args.rounds, "steps_per_round": args.steps,
                 "sizes": {}}
    for size, (cfg, batch) in SIZES.items():
        built = models(cfg)
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1))
        with torch.no_grad():  # the conversion is exact: the comparison is of the same model
            diff = (built["gpt"].eval()(x[:, :-1])[0]
                    - built["gpt2_transformers"].eval()(input_ids=x[:, :-1]).logits).abs().max()
        optimizers = {n: torch.optim.AdamW(m.train().parameters(), lr=1e-4) for n, m in built.items()}
        for name, model in built.items():  # warm-up (allocator, first-call paths)
            step_ms(name, model, x, 3, optimizers[name])
        per_round: dict[str, list[float]] = {n: [] for n in built}
        for _ in range(args.rounds):
            for name, model in built.items():
                per_round[name].append(step_ms(name, model, x, args.steps, optimizers[name]))
        median = {n: statistics.median(v) for n, v in per_round.items()}
        out["sizes"][size] = {
            "model": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "vocab_size": cfg.vocab_size,
                      "batch": batch, "tokens_per_step": batch * cfg.block_size},
            "params": {n: sum(p.numel() for p in m.parameters()) for n, m in built.items()},
            "max_abs_logit_diff_gpt_vs_gpt2": float(diff),
            "step_ms_median": {n: round(v, 3) for n, v in median.items()},
            "step_ms_rounds": {n: [round(t, 3) for t in v] for n, v in per_round.items()},
            "gpt2_transformers_over_gpt": round(median["gpt2_transformers"] / median["gpt"], 3),
            "llama_transformers_over_gpt": round(median["llama_transformers"] / median["gpt"], 3),
        }
        print(f"{size}: step ms (median of {args.rounds} rounds) "
              + ", ".join(f"{n} {v:.2f}" for n, v in median.items())
              + f"; GPT2LMHeadModel / ours = {median['gpt2_transformers'] / median['gpt']:.2f}x")
    loads.append(os.getloadavg())
    import transformers

    out["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                      "python": platform.python_version(), "torch": torch.__version__,
                      "transformers": transformers.__version__, "torch_threads": 1,
                      "load_avg_1_5_15_at_start": [round(v, 2) for v in loads[0]],
                      "load_avg_1_5_15_at_end": [round(v, 2) for v in loads[1]],
                      "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "git_commit": machine()["git_commit"]}
    path = ROOT / "benchmarks" / "results" / "hf_models.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
