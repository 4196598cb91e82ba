"""Build fusedalign's embedded resources, deterministically.

Writes, under ``fusedalign/resources/`` (or ``--out``):

- ``zen.txt``: the Zen of Python, the theme of everything below.
- ``datasets/zen/<config>/{train,test}.jsonl``: the "zen" datasets in every format the
  trainers read, standard and conversational, with TRL's config names.
- ``tokenizer/``: a byte-level BPE trained on the dataset text, with ChatML special tokens
  and a chat template whose assistant turns are wrapped in ``{% generation %}`` markers.
- ``models/<name>/``: tiny randomly initialised causal LMs (fixed seed) of three families,
  saved with ``save_pretrained`` so they load through ``AutoModelForCausalLM.from_pretrained``.
  Each model directory also holds a copy of the tokenizer.
- ``models/tiny-zen-teacher/``: a tiny Llama (tiny-llama's shape) fine-tuned to recite the Zen
  of Python, line by line, each line closed by the end-of-text token: the teacher of
  ``fusedalign distillation``'s demo (a few seconds of full-batch Adam on the CPU, seeded).

Run from the repository root::

    python scripts/build_resources.py            # rebuild in place
    python scripts/build_resources.py --out /tmp/r && diff -r /tmp/r fusedalign/resources

The output is committed; nothing is built or downloaded at run time.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

ZEN = [
    "Beautiful is better than ugly.",
    "Explicit is better than implicit.",
    "Simple is better than complex.",
    "Complex is better than complicated.",
    "Flat is better than nested.",
    "Sparse is better than dense.",
    "Readability counts.",
    "Special cases aren't special enough to break the rules.",
    "Although practicality beats purity.",
    "Errors should never pass silently.",
    "Unless explicitly silenced.",
    "In the face of ambiguity, refuse the temptation to guess.",
    "There should be one-- and preferably only one --obvious way to do it.",
    "Although that way may not be obvious at first unless you're Dutch.",
    "Now is better than never.",
    "Although never is often better than *right* now.",
    "If the implementation is hard to explain, it's a bad idea.",
    "If the implementation is easy to explain, it may be a good idea.",
    "Namespaces are one honking great idea -- let's do more of those!",
]

# Word swaps that turn an aphorism into a plausible but wrong one.
ANTONYMS = {
    "better": "worse", "worse": "better", "never": "always", "always": "never",
    "hard": "easy", "easy": "hard", "bad": "good", "good": "bad",
    "ugly.": "beautiful.", "implicit.": "explicit.", "complex.": "simple.",
    "complicated.": "complex.", "nested.": "flat.", "dense.": "sparse.",
    "counts.": "hurts.", "silently.": "loudly.", "silenced.": "raised.",
    "guess.": "wait.", "purity.": "elegance.", "rules.": "habits.",
    "one": "two", "Dutch.": "French.", "refuse": "embrace", "those!": "these!",
    "should": "must", "beats": "loses to", "obvious": "hidden", "great": "terrible",
}

SEED = 1234
TEST_FRACTION = 0.12
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML. Assistant turns sit inside {% generation %} so that
# apply_chat_template(..., return_assistant_tokens_mask=True) marks them; the prompt rendered
# with add_generation_prompt=True is a prefix of the rendered conversation (the data layer
# relies on that to split prompt from completion).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MODEL_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=1024,
)


# ----------------------------------------------------------------------------- datasets


def _splits() -> list[tuple[int, int, str, str]]:
    """Every (line, k, prompt, completion) with the line cut after its k-th word."""
    out = []
    for i, line in enumerate(ZEN):
        words = line.split(" ")
        for k in range(1, len(words)):
            out.append((i, k, " ".join(words[:k]), " " + " ".join(words[k:])))
    return out


def _negate(line: str, k: int) -> str | None:
    """The completion of ``line`` after word k with antonyms swapped in, if any changed."""
    words = line.split(" ")
    tail = [ANTONYMS.get(w, w) for w in words[k:]]
    return None if tail == words[k:] else " " + " ".join(tail)


def _borrow(rng: random.Random, i: int, n_words: int, chosen: str, avoid: set[str]) -> str:
    """The last ``n_words`` words of another aphorism: a fluent but wrong continuation."""
    candidates = []
    for j, other in enumerate(ZEN):
        words = other.split(" ")
        if j == i or len(words) < 2:
            continue
        tail = " " + " ".join(words[-min(n_words, len(words) - 1):])
        if tail != chosen and tail not in avoid:
            candidates.append(tail)
    return rng.choice(candidates)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text.strip()}]


def build_rows() -> dict[str, dict[str, list[dict]]]:
    """All zen configs as ``{config: {split: rows}}``."""
    rng = random.Random(SEED)
    splits = _splits()
    test_keys = set(rng.sample([(i, k) for i, k, _, _ in splits], round(TEST_FRACTION * len(splits))))

    # Two wrong continuations per cut: antonyms when they apply, else borrowed tails.
    pref = []  # (key, prompt, chosen, rejected)
    for i, k, prompt, chosen in splits:
        n_words = len(chosen.split())
        rejected = []
        negated = _negate(ZEN[i], k)
        if negated is not None:
            rejected.append(negated)
        while len(rejected) < 2:
            rejected.append(_borrow(rng, i, n_words, chosen, set(rejected)))
        pref += [((i, k), prompt, chosen, r) for r in rejected]

    # Language modelling: each line, and runs of 2 and 3 consecutive lines.
    lm_texts = list(ZEN)
    for n in (2, 3):
        lm_texts += ["\n".join(ZEN[s:s + n]) for s in range(len(ZEN) - n + 1)]
    lm_test = set(rng.sample(range(len(lm_texts)), round(TEST_FRACTION * len(lm_texts))))

    # Multi-turn chats for conversational LM: consecutive lines, each cut at its middle.
    def cut(line: str) -> tuple[str, str]:
        words = line.split(" ")
        k = max(1, len(words) // 2)
        return " ".join(words[:k]), " ".join(words[k:])

    chats = []
    for n in (1, 2, 3):
        for s in range(len(ZEN) - n + 1):
            messages = []
            for line in ZEN[s:s + n]:
                p, c = cut(line)
                messages += _user(p) + _assistant(c)
            chats.append(messages)
    chat_test = set(rng.sample(range(len(chats)), round(TEST_FRACTION * len(chats))))

    configs: dict[str, dict[str, list[dict]]] = {}

    def add(name: str, keyed_rows: list[tuple[bool, dict]]) -> None:
        configs[name] = {
            "train": [r for is_test, r in keyed_rows if not is_test],
            "test": [r for is_test, r in keyed_rows if is_test],
        }

    add("standard_language_modeling", [(j in lm_test, {"text": t}) for j, t in enumerate(lm_texts)])
    add("conversational_language_modeling",
        [(j in chat_test, {"messages": m}) for j, m in enumerate(chats)])
    add("standard_prompt_only", [((i, k) in test_keys, {"prompt": p}) for i, k, p, _ in splits])
    add("conversational_prompt_only",
        [((i, k) in test_keys, {"prompt": _user(p)}) for i, k, p, _ in splits])
    add("standard_prompt_completion",
        [((i, k) in test_keys, {"prompt": p, "completion": c}) for i, k, p, c in splits])
    add("conversational_prompt_completion",
        [((i, k) in test_keys, {"prompt": _user(p), "completion": _assistant(c)})
         for i, k, p, c in splits])
    add("standard_preference",
        [(key in test_keys, {"prompt": p, "chosen": c, "rejected": r}) for key, p, c, r in pref])
    add("conversational_preference",
        [(key in test_keys, {"prompt": _user(p), "chosen": _assistant(c), "rejected": _assistant(r)})
         for key, p, c, r in pref])
    add("standard_implicit_prompt_preference",
        [(key in test_keys, {"chosen": p + c, "rejected": p + r}) for key, p, c, r in pref])
    add("conversational_implicit_prompt_preference",
        [(key in test_keys, {"chosen": _user(p) + _assistant(c), "rejected": _user(p) + _assistant(r)})
         for key, p, c, r in pref])

    # Unpaired: per cut, the true continuation (desirable) and one wrong one, interleaved.
    unpaired = []
    for n in range(0, len(pref), 2):
        key, p, c, _ = pref[n]
        r = pref[n + rng.randrange(2)][3]
        unpaired += [(key, p, c, True), (key, p, r, False)]
    add("standard_unpaired_preference",
        [(key in test_keys, {"prompt": p, "completion": x, "label": y}) for key, p, x, y in unpaired])
    add("conversational_unpaired_preference",
        [(key in test_keys, {"prompt": _user(p), "completion": _assistant(x), "label": y})
         for key, p, x, y in unpaired])
    return configs


def write_datasets(out: Path, configs: dict[str, dict[str, list[dict]]]) -> None:
    root = out / "datasets" / "zen"
    for name, splits in configs.items():
        for split, rows in splits.items():
            path = root / name / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------- tokenizer


def _corpus(configs: dict[str, dict[str, list[dict]]]) -> list[str]:
    """Every string a zen row renders to, standard text and chat-formatted."""
    texts = ["The Zen of Python, by Tim Peters", "\n".join(ZEN)]
    for splits in configs.values():
        for rows in splits.values():
            for row in rows:
                for value in row.values():
                    if isinstance(value, str):
                        texts.append(value)
                    elif isinstance(value, list):
                        texts += [f"{m['role']}\n{m['content']}\n" for m in value]
    return texts


def build_tokenizer(out: Path, configs: dict[str, dict[str, list[dict]]]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(configs), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
        padding_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE
    target = out / "tokenizer"
    if target.exists():
        shutil.rmtree(target)
    fast.save_pretrained(str(target))
    return fast


# ------------------------------------------------------------------------------- models


def _model_configs(vocab_size: int, eos_id: int) -> dict:
    from transformers import Gemma2Config, LlamaConfig, Qwen2Config

    ids = dict(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    return {
        "tiny-qwen2": Qwen2Config(vocab_size=vocab_size, tie_word_embeddings=False, **MODEL_SHAPE, **ids),
        "tiny-llama": LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=True, **MODEL_SHAPE, **ids),
        "tiny-gemma2": Gemma2Config(
            vocab_size=vocab_size,
            tie_word_embeddings=True,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=64,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            **MODEL_SHAPE,
            **ids,
        ),
    }


def build_models(out: Path, tokenizer_dir: Path, tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    vocab_size = -(-len(tokenizer) // 8) * 8  # round up to a multiple of 8
    for seed, (name, config) in enumerate(_model_configs(vocab_size, tokenizer.eos_token_id).items()):
        torch.manual_seed(SEED + seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        target = out / "models" / name
        if target.exists():
            shutil.rmtree(target)
        model.save_pretrained(str(target))
        for f in sorted(tokenizer_dir.iterdir()):
            shutil.copy(f, target / f.name)


TEACHER = "tiny-zen-teacher"
TEACHER_STEPS = 400


def build_teacher(out: Path, tokenizer_dir: Path, tokenizer) -> float:
    """The demo's teacher: tiny-llama's shape, trained on every Zen line (+ EOS) until it recites
    them; returns the final training loss (nats a token)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED + 100)
    vocab_size = -(-len(tokenizer) // 8) * 8
    config = _model_configs(vocab_size, tokenizer.eos_token_id)["tiny-llama"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rows = [tokenizer(line)["input_ids"] + [tokenizer.eos_token_id] for line in ZEN]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.eos_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = ids.masked_fill(mask == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(TEACHER_STEPS):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    target = out / "models" / TEACHER
    if target.exists():
        shutil.rmtree(target)
    model.save_pretrained(str(target))
    for f in sorted(tokenizer_dir.iterdir()):
        shutil.copy(f, target / f.name)
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = Path(__file__).resolve().parents[1] / "fusedalign" / "resources"
    parser.add_argument("--out", type=Path, default=default, help="resources directory to write")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    (out / "zen.txt").write_text("\n".join(ZEN) + "\n", encoding="utf-8")
    configs = build_rows()
    if (out / "datasets").exists():
        shutil.rmtree(out / "datasets")
    write_datasets(out, configs)
    tokenizer = build_tokenizer(out, configs)
    build_models(out, out / "tokenizer", tokenizer)
    teacher_loss = build_teacher(out, out / "tokenizer", tokenizer)
    sizes = {name: {s: len(r) for s, r in splits.items()} for name, splits in configs.items()}
    print(json.dumps({"vocab": len(tokenizer), "datasets": sizes, "teacher_loss": teacher_loss}, indent=1))


if __name__ == "__main__":
    main()
