"""``pdserve generate``: load a model, complete one prompt, print the text."""

from __future__ import annotations

import argparse
import sys

from pdserve.attention import BACKENDS
from pdserve.engine.config import DTYPE_NAMES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve generate", description=__doc__)
    p.add_argument("--model", default="tiny", help="built-in name or Hugging Face directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES)
    p.add_argument("--device", default="cpu")
    p.add_argument("--attention-backend", default="auto", choices=BACKENDS)
    p.add_argument("--verbose", action="store_true", help="also print token ids and reason")
    return p


def generate_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
            ignore_eos=args.ignore_eos)
        llm = LLM(args.model, dtype=args.dtype, device=args.device,
                  attention_backend=args.attention_backend)
        prompt = args.prompt
        if args.chat:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        completion = llm.generate(prompt, params)[0]
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(completion.text)
    if args.verbose:
        print(f"token_ids={completion.token_ids} finish_reason={completion.finish_reason}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(generate_main(sys.argv[1:]))
