"""The built-in models' tokenizer: byte-level BPE whose merges are learned here, in plain Python
with a fixed tie-break, from a small embedded text, so every machine builds the same vocabulary
(the Rust trainer breaks ties through hash-map order, which is not stable).

    ids 0..4      <s> </s> <|system|> <|user|> <|assistant|>   (special)
    ids 5..260    the 256 bytes, in byte order (GPT-2 printable mapping)
    ids 261..     merges, most frequent pair first
"""

from __future__ import annotations

import functools
from collections import Counter

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from pdserve.tokenizer import bytes_to_unicode

SPECIAL_TOKENS = ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
BOS, EOS = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]
VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_CORPUS = """\
The river starts as a thin line of water under the snow, and for a long time nobody notices it.
Then it meets another stream, and another, and by the time it reaches the town it has a name,
a bridge, and a story that everyone tells differently. The old ferryman says the river was here
before the hills; the children say it was made by a giant who lost his way. Both are wrong, and
both are right in the way that stories are right: they give people a reason to look at the water.

In the morning the market opens near the bridge. Bakers bring bread, farmers bring apples and
cheese, and a woman from the north sells wool in every colour you can think of. Prices are
written on small boards, but nobody pays the written price. You ask, you smile, you offer less,
and after a while you both agree on a number that makes each of you feel a little clever.

A good question is worth more than a quick answer. When you are asked what time it is, you can
look at the clock and reply; when you are asked why the clock shows that time, you have to think
about the sun, the earth, the people who agreed on hours and minutes, and the trains that needed
every station to share the same time. Simple questions often open the largest doors.

Computers read text as numbers. A tokenizer cuts a sentence into pieces, gives every piece an
id, and later turns the ids back into letters. Common words become single pieces, rare words are
split into smaller parts, and any byte at all can still be written, so nothing is ever lost.
The model then reads the ids, one after another, and predicts which id should come next.

Please write a short poem about the sea. Tell me a story about a cat who wanted to fly. What is
the capital of France? How many days are there in a year? Explain how a bicycle stays upright.
Summarise the following paragraph in one sentence. Translate this word into German. Thank you!
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 24 32 64 100 128 256 512 1000 2024 3.14 -1 +1 = % $ #.
"""


def _learn_merges(text: str, num_merges: int) -> list[tuple[str, str]]:
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    counts = Counter(piece for piece, _ in pre.pre_tokenize_str(text))
    words = [(list(w), c) for w, c in sorted(counts.items())]
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for syms, c in words:
            for pair in zip(syms, syms[1:], strict=False):
                pairs[pair] += c
        if not pairs:
            break
        # Most frequent pair; ties go to the lexicographically smallest (stable everywhere).
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        merged = best[0] + best[1]
        for syms, _c in words:
            i = 0
            while i < len(syms) - 1:
                if syms[i] == best[0] and syms[i + 1] == best[1]:
                    syms[i : i + 2] = [merged]
                i += 1
    return merges


@functools.cache
def tokenizer_json() -> str:
    """The serialized tokenizer.json (cached: learning the merges takes a moment)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in bytes_to_unicode():
        vocab[ch] = len(vocab)
    merges = _learn_merges(_CORPUS, VOCAB_SIZE - len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return str(tok.to_str())


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
