"""Recompute an lm-evaluation-harness loglikelihood run with transformers and compare.

    python bench/lm_eval/compare_hf.py MODEL_DIR SAMPLES.jsonl

Reads the per-sample log of ``lm_eval ... --log_samples`` (each choice's summed continuation
logprob as pdserve returned it), scores every (context, continuation) pair with
``transformers`` on the same weights in float32 (encoded as lm-eval encodes them:
``encode(context + continuation)`` split after ``encode(context)``), and prints the largest
difference and both accuracies.
"""

from __future__ import annotations

import json
import sys

import torch
import transformers


def main(model_dir: str, samples_path: str) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    worst, n, correct_hf, correct_served = 0.0, 0, 0, 0
    with open(samples_path, encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    for sample in samples:
        hf_scores, served = [], []
        for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = args["arg_0"], args["arg_1"]
            whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
            ctx = tok(context, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
            cont = whole[len(ctx):]
            score = sum(float(logits[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
            hf_scores.append(score)
            served.append(float(resp[0][0]))
            worst = max(worst, abs(score - served[-1]))
            n += 1
        target = int(sample["target"])
        correct_hf += int(max(range(len(hf_scores)), key=hf_scores.__getitem__) == target)
        correct_served += int(max(range(len(served)), key=served.__getitem__) == target)
    print(json.dumps({"pairs": n, "max_abs_diff": worst, "acc_transformers":
                      correct_hf / len(samples), "acc_served": correct_served / len(samples)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
