"""Tiny, deterministic test assets, built from a seed on the spot: a tokenizer, targets and chats.

One module builds them all, for the tests and for `eyas demo`:

- a byte-level BPE tokenizer with a chat template that marks generation;
- a tiny `DeepseekV3ForCausalLM` (MLA + MoE) and a tiny `LlamaForCausalLM`, in dimensions that
  vLLM's CPU build also accepts (docs/ARCHITECTURE.md, Engines on CPU: head_dim 64; kv_lora_rank + qk_rope_head_dim
  == 576; "topk_method": "noaux_tc" written into config.json);
- a synthetic multi-turn chat dataset (ShareGPT form, with system turns and <think>
  reasoning), a few rows of it malformed on purpose.

Heavy imports (torch, transformers, tokenizers) happen inside the functions.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from eyas.state import contract

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>"]

# Assistant content sits inside {% generation %} so that transformers can return the
# assistant-token mask; the closing <|end|> is generated too (the model must learn to stop).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}<|end|>"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}<|end|>"
    "{% elif message['role'] == 'assistant' %}<|assistant|>"
    "{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORDS = (
    "the a small large quick slow red blue green model draft target token layer hidden state "
    "cat dog bird fish tree river stone cloud light shadow train learn predict verify accept "
    "one two three four five six seven eight nine ten and or but so then because if when "
    "is was will can should may run walk fly swim sing write read count add think answer"
).split()


def _sentence(rng: random.Random, lo: int = 4, hi: int = 12) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + rng.choice([".", ".", "?", "!"])


def _count_reply(rng: random.Random) -> str:
    # A predictable pattern: drafts can learn it, so acceptance has something to measure.
    start = rng.randint(1, 20)
    return "Counting: " + " ".join(str(n) for n in range(start, start + rng.randint(5, 12))) + "."


# The demo target's own voice (fit_to_chats(voice="target")). The chat dataset stands for a
# public one, written by another model; the target answers the same prompts its own way, as a
# real target does, which is what the regenerate stage is for. Deterministic (each dataset
# answer has one answer in the target's voice, drawn from nothing else) and clearly not the
# dataset's: no <think>; even numbers up to 24 where the dataset counts by ones (the same number
# tokens, in another pattern); and where the dataset writes sentences of random words from
# _WORDS, one of three fixed phrases in words of the target's own, none of whose tokens any
# answer of the dataset holds (but an answer's first letter): a draft that learns from the
# dataset alone has never seen them, and its vocabulary (the vocab stage counts the answers'
# tokens) has none of them.
VOICES = ("dataset", "target")
_PHRASES = (
    "my helpful assistant shall care",
    "how far are an bear day",
    "laugh sight thin wall work stir",
)


def _in_target_voice(reply: str) -> str:
    """The dataset's `reply` as the demo target says it (see VOICES): each sentence becomes the
    phrase its first word picks."""
    import re

    reply = re.sub(r"^<think>.*?</think>", "", reply)
    if reply.startswith("Counting:"):
        numbers = [int(n) for n in reply.removeprefix("Counting:").strip(" .").split()]
        start = min(numbers[0] + numbers[0] % 2, 20)
        return "even: " + " ".join(str(n) for n in range(start, 25, 2)[: max(3, len(numbers))]) + "."
    firsts = [s.split()[0].lower() for s in re.split(r"[.?!]\s*", reply) if s]
    return " ".join(_PHRASES[_WORDS.index(w) % len(_PHRASES)] + "." for w in firsts)


def conversations(n: int = 300, seed: int = 0, voice: str = "dataset") -> list[dict]:
    """`n` well-formed ShareGPT conversations (`conversations` of {from, value}); with
    voice="target", the same prompts answered in the demo target's voice (_in_target_voice)."""
    if voice not in VOICES:
        raise ValueError(f"voice {voice!r}: choose from {list(VOICES)}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = []
        if rng.random() < 0.3:
            turns.append({"from": "system", "value": "You are a helpful assistant. " + _sentence(rng)})
        for _ in range(rng.randint(1, 3)):
            turns.append({"from": "human", "value": _sentence(rng)})
            reply = (
                _count_reply(rng) if rng.random() < 0.4 else " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
            )
            if rng.random() < 0.25:
                reply = f"<think>{_sentence(rng)}</think>{reply}"
            turns.append({"from": "gpt", "value": _in_target_voice(reply) if voice == "target" else reply})
        rows.append({"id": f"conv-{i}", "conversations": turns})
    return rows


# Malformed rows, one per reason that `prepare` must skip and count. Raw bytes, since some
# are not even JSON or UTF-8.
MALFORMED_LINES: dict[str, bytes] = {
    "invalid_json": b'{"conversations": [{"from": "human", "value": "hi"}\n',
    "unknown_role": json.dumps(
        {"conversations": [{"from": "robot", "value": "beep"}, {"from": "gpt", "value": "ok"}]}
    ).encode()
    + b"\n",
    "missing_role": json.dumps({"conversations": [{"value": "who am I"}, {"from": "gpt", "value": "ok"}]}).encode()
    + b"\n",
    "empty_content": json.dumps(
        {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "ok"}]}
    ).encode()
    + b"\n",
    "wrong_type": json.dumps(
        {"conversations": [{"from": "human", "value": 42}, {"from": "gpt", "value": "ok"}]}
    ).encode()
    + b"\n",
    "not_utf8": b'{"conversations": [{"from": "human", "value": "caf\xe9"}, {"from": "gpt", "value": "ok"}]}\n',
}


def write_dataset(path: Path, n: int = 300, seed: int = 0, malformed: bool = True) -> Path:
    """Write a ShareGPT JSONL file: `n` good conversations with the malformed lines spread in."""
    rows = [json.dumps(r).encode() + b"\n" for r in conversations(n, seed)]
    if malformed:
        rng = random.Random(seed + 1)
        for line in MALFORMED_LINES.values():
            rows.insert(rng.randrange(len(rows) + 1), line)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(rows))
    return path


def build_tokenizer(out_dir: Path, seed: int = 0, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on the synthetic chats and save it with its template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [t["value"] for c in conversations(400, seed) for t in c["conversations"]]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


@dataclass(frozen=True)
class TinySpec:
    """The dimensions of a tiny target, small enough for CPU and accepted by vLLM's CPU build."""

    family: str  # "deepseek_v3" | "llama"
    hidden_size: int = 64
    num_hidden_layers: int = 8
    intermediate_size: int = 128


def _deepseek_config(spec: TinySpec, vocab: int, tokenizer):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=32,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.0,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=2048,
        rope_scaling=None,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_nextn_predict_layers=0,
    )


def _llama_config(spec: TinySpec, vocab: int, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.hidden_size // 64,
        num_key_value_heads=spec.hidden_size // 64,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_model(
    out_dir: Path, family: str = "deepseek_v3", seed: int = 0, spec: TinySpec | None = None, dtype: str = "float32"
) -> Path:
    """Save a random-weight tiny target (weights, config.json, tokenizer) to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = spec or TinySpec(family, hidden_size=64 if family == "deepseek_v3" else 128)
    tokenizer = build_tokenizer(out_dir, seed)
    vocab = len(tokenizer)
    config = {"deepseek_v3": _deepseek_config, "llama": _llama_config}[family](spec, vocab, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    if family == "deepseek_v3":
        _vllm_routing(out_dir)
    return out_dir


HEAD_NORM = 1.0  # the fitted head's mean row norm (see fit_to_chats)
# Whose answers build_all's fitted target learns: its own (the chats stay the dataset's).
FIT_VOICE = "target"


def voice_id(voice: str, seed: int = 0) -> str:
    """`voice` and a digest of the chats it writes (what a fitted head learnt from)."""
    import hashlib

    text = json.dumps(conversations(seed=seed, voice=voice), sort_keys=True).encode()
    return f"{voice} {hashlib.sha256(text).hexdigest()[:12]}"


def fit_to_chats(
    model_dir: Path, steps: int, seed: int = 0, lr: float = 0.05, voice: str = "dataset", answers_only: bool = False
) -> float:
    """Fit the tiny target's output head (lm_head) to the synthetic chats and save it in place;
    the final next-token loss.

    For the demo: a random-weight target answers in byte tokens that no chat contains, so no
    draft can learn to predict its answers. The head alone is fitted, on the final hidden
    states of every chat computed once (a softmax regression, seconds on a CPU, where training
    the whole MLA + MoE stack takes minutes): the target then answers in the chats' words and
    patterns, and the evaluate stage measures a draft that has something to learn. The tests
    keep the random targets, on whose figures they were calibrated.

    `voice`: whose answers the head learns, the dataset's or the target's own (the same
    prompts, conversations(voice="target")). `answers_only`: the loss on the answers' tokens
    alone, as a chat model is tuned; else on every token of the chats.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eyas.workers.data.reader import normalize

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    features, targets = [], []
    with torch.no_grad():
        # The prompts write_dataset writes, as prepare reads them.
        for c in conversations(seed=seed, voice=voice):
            messages = normalize(c, "sharegpt", len(tokenizer)).messages
            rendered = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids = rendered["input_ids"]
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            keep = torch.tensor(rendered["assistant_masks"][1:], dtype=torch.bool) if answers_only else slice(None)
            features.append(hidden[:-1][keep])
            targets.append(torch.tensor(ids[1:])[keep])
    x, y = torch.cat(features), torch.cat(targets)
    head = model.lm_head
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    loss = torch.tensor(float("nan"))
    for step in range(1, steps + 1):
        loss = torch.nn.functional.cross_entropy(head(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps:
            _progress(f"fitting the output head: step {step}/{steps}, loss {loss.item():.3f}")
    with torch.no_grad():
        # Scaling a row-normalised head changes no greedy choice, only how sharp the target's
        # distribution is: the fit leaves rows ~40x the initial norm (logits near 50), a target
        # so peaked that a draft trained on its distribution barely learns.
        head.weight.mul_(HEAD_NORM / head.weight.norm(dim=1).mean())
    # Only the weights change: save_pretrained would rewrite config.json without the keys that
    # only vLLM reads (_vllm_routing), so the config is kept as it was.
    config = (model_dir / "config.json").read_text()
    model.save_pretrained(model_dir, safe_serialization=True)
    (model_dir / "config.json").write_text(config)
    return float(loss.detach())


def _vllm_routing(model_dir: Path) -> None:
    """vLLM's DeepseekV2 loader reads topk_method and scoring_func; transformers writes neither
    (its DeepseekV3 always routes with sigmoid, vLLM's default is softmax), and the target must
    compute the same function in both engines: a draft trained on transformers' hidden states
    is evaluated against vLLM's."""
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["topk_method"] = "noaux_tc"
    cfg["scoring_func"] = "sigmoid"
    cfg_path.write_text(json.dumps(cfg, indent=2))


MARKER = "eyas-asset.json"


ASSETS = ("tiny-deepseek", "tiny-llama", "chat.jsonl")


def _progress(text: str) -> None:
    import sys

    print(contract.ASSET_PROGRESS + text, file=sys.stderr, flush=True)


def build_all(
    root: Path, seed: int = 0, fit_steps: int = 0, only: tuple[str, ...] | list[str] = ASSETS
) -> dict[str, Path]:
    """Everything the demo and the end-to-end tests need, under `root` (`only` those named);
    idempotent.

    `fit_steps` > 0 trains the tiny DeepSeek target on the chats' prompts first, answered in its
    own voice (fit_to_chats, FIT_VOICE); chat.jsonl keeps the dataset's answers. Each model
    is built in a scratch directory and renamed into place whole, with a marker of how it was
    built: an interrupted build leaves nothing that looks finished, and a model built another
    way (another seed, fitted or not) is rebuilt.
    """
    import shutil

    root.mkdir(parents=True, exist_ok=True)
    for scratch in root.glob(".*.partial"):  # an interrupted build's
        if scratch.is_dir():
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            scratch.unlink()
    unknown = sorted(set(only) - set(ASSETS))
    if unknown:
        raise ValueError(f"unknown assets {unknown}: choose from {list(ASSETS)}")
    out = {name: root / name for name in ASSETS if name in only}
    for name, family in (("tiny-deepseek", "deepseek_v3"), ("tiny-llama", "llama")):
        if name not in out:
            continue
        fit = fit_steps if family == "deepseek_v3" else 0
        how = {
            "family": family,
            "seed": seed,
            "fit_steps": fit,
            "head_norm": HEAD_NORM if fit else None,
            # A fitted target answers in its own voice, not the dataset's (fit_to_chats): a
            # digest of the chats it learnt, so that a voice written otherwise is rebuilt.
            "voice": voice_id(FIT_VOICE, seed) if fit else None,
            "answers_only": True if fit else None,
        }
        marker = out[name] / MARKER
        built = json.loads(marker.read_text()) if marker.exists() else {}
        if {k: built.get(k) for k in how} == how:
            continue
        scratch = root / f".{name}.partial"
        shutil.rmtree(scratch, ignore_errors=True)
        _progress(f"{name}: random weights and tokenizer")
        build_model(scratch, family, seed)
        if how["fit_steps"]:
            _progress(f"{name}: fitting its output head to the chats ({how['fit_steps']} steps)")
            loss = fit_to_chats(scratch, how["fit_steps"], seed, voice=FIT_VOICE, answers_only=True)
            how["final_loss"] = round(loss, 4)
        (scratch / MARKER).write_text(json.dumps(how))
        shutil.rmtree(out[name], ignore_errors=True)
        scratch.rename(out[name])
    if "chat.jsonl" in out and not out["chat.jsonl"].exists():
        _progress("chat.jsonl: synthetic chats")
        write_dataset(root / ".chat.jsonl.partial", seed=seed).rename(out["chat.jsonl"])
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m eyas.workers.models.assets DIR`: build everything under DIR; print the paths as JSON.

    The demo runs this in a child process, so that its own process (the CLI) never imports torch.
    """
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m eyas.workers.models.assets", description=main.__doc__.splitlines()[0]
    )
    parser.add_argument("dir", type=Path, help="where to build (created if missing; existing assets are kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fit-steps",
        type=int,
        default=0,
        help="train the tiny DeepSeek target on the chats for this many steps (the demo's)",
    )
    parser.add_argument(
        "--only", nargs="+", choices=ASSETS, default=list(ASSETS), help="build these assets only (default: all)"
    )
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    made = build_all(args.dir.absolute(), seed=args.seed, fit_steps=args.fit_steps, only=args.only)
    print(json.dumps({k: str(v) for k, v in made.items()}))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
